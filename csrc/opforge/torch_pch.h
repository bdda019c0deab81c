// The torch headers the operator wrappers include, precompiled by the CMake
// route (CMakeLists.txt, OPFORGE_PCH), which compiles each wrapper on its own:
// parsing them is most of a wrapper's compile time. (The JIT route compiles the
// wrappers as one unit instead, and needs no precompiled header.) It includes
// only torch's headers, never ours, so that editing a wrapper or common.h
// never invalidates it; a file still includes what it uses, and builds the
// same without this header.
#pragma once

// opforge/common.h's
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
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
