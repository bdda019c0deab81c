// The torch headers the operator wrappers include, precompiled once per
// torch, compiler and flags (opforge.build.pch) and loaded by every .cpp of
// the op library with -include: parsing them is most of a wrapper's compile
// time. It includes only torch's headers, never ours, so that editing a
// wrapper or common.h never invalidates it; a file still includes what it
// uses, and builds the same without this header (CMake's and setuptools'
// routes, or OPFORGE_PCH=0).
#pragma once

// opforge/common.h's
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

// opforge/elementwise.h's and cpu_vec.h's
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/DimVector.h>
#include <c10/util/strides.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// the ops' own
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
