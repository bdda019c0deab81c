"""opforge.builder.inline: ops as strings (the load_inline tutorial's load_inline) and a folder of
tutorial-style pybind11 code (the add2 tutorial's add2), both through the one JIT engine.

Each C++ build costs 5-20 s on two cores, so every test builds at most once and
the checks that need no compiler ask inline_config / pybind_folder_config."""

from __future__ import annotations

import json
import re
import stat
import textwrap
from pathlib import Path

import pytest
import torch

from opforge.builder import BuildError, Library
from opforge.builder.inline import build_pybind_folder, inline, inline_config, pybind_folder_config

# The load_inline tutorial, as written for torch's load_inline.
HELLO_CPP = textwrap.dedent(
    """
    std::string hello() {
      return "Hello World!";
    }
    """
)

# The load_inline tutorial's CUDA example, with what it leaves out: input checks, the device
# guard, torch's current stream, a launch check, and no launch for an empty input.
SQUARE_CUDA = textwrap.dedent(
    """
    #include <climits>
    #include <ATen/cuda/CUDAContext.h>
    #include <c10/cuda/CUDAException.h>
    #include <c10/cuda/CUDAGuard.h>

    __global__ void square_matrix_kernel(const float* matrix, float* result, int width, int height) {
        int row = blockIdx.y * blockDim.y + threadIdx.y;
        int col = blockIdx.x * blockDim.x + threadIdx.x;

        if (row < height && col < width) {
            int idx = row * width + col;
            result[idx] = matrix[idx] * matrix[idx];
        }
    }

    torch::Tensor square_matrix(torch::Tensor matrix) {
        TORCH_CHECK(matrix.is_cuda(), "square_matrix: matrix must be on a CUDA device, got ", matrix.device());
        TORCH_CHECK(matrix.dim() == 2, "square_matrix: matrix must be 2-D, got ", matrix.dim(), "-D");
        TORCH_CHECK(matrix.scalar_type() == torch::kFloat, "square_matrix: matrix must be float32, got ", matrix.scalar_type());
        TORCH_CHECK(matrix.numel() <= INT_MAX, "square_matrix: at most 2^31-1 elements (int indices), got ", matrix.numel());
        const c10::cuda::CUDAGuard guard(matrix.device());
        const auto input = matrix.contiguous();
        const auto height = input.size(0);
        const auto width = input.size(1);
        auto result = torch::empty_like(input);
        if (result.numel() == 0) {
            return result;
        }

        dim3 threads_per_block(16, 16);
        dim3 number_of_blocks((width + threads_per_block.x - 1) / threads_per_block.x,
                              (height + threads_per_block.y - 1) / threads_per_block.y);
        TORCH_CHECK(number_of_blocks.y <= 65535, "square_matrix: at most ", 65535 * 16, " rows, got ", height);

        square_matrix_kernel<<<number_of_blocks, threads_per_block, 0, at::cuda::getCurrentCUDAStream()>>>(
            input.data_ptr<float>(), result.data_ptr<float>(), static_cast<int>(width), static_cast<int>(height));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return result;
    }
    """
)
SQUARE_CPP = "torch::Tensor square_matrix(torch::Tensor matrix);"

# A TORCH_LIBRARY operator with a CPU kernel. Only the headers it needs: a
# fifth of the compile time of torch/extension.h.
TWICE = textwrap.dedent(
    """
    #include <ATen/core/Tensor.h>
    #include <ATen/ops/empty_like.h>
    #include <torch/library.h>

    static at::Tensor twice(const at::Tensor& x) {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "opforge_inline_test::twice: x must be float32, got ", x.scalar_type());
      const at::Tensor in = x.contiguous();
      at::Tensor out = at::empty_like(in);
      const float* src = in.const_data_ptr<float>();
      float* dst = out.mutable_data_ptr<float>();
      for (int64_t i = 0; i < in.numel(); ++i) {
        dst[i] = 2.0f * src[i];
      }
      return out;
    }

    TORCH_LIBRARY(opforge_inline_test, m) { m.def("twice(Tensor x) -> Tensor"); }
    TORCH_LIBRARY_IMPL(opforge_inline_test, CPU, m) { m.impl("twice", &twice); }
    """
)

# The add2 tutorial's add2: the header of the launcher on raw pointers, and the tutorial's
# torch wrapper with the checks it leaves out. Here the launcher is a CPU loop
# standing in for add2.cu; the CUDA test builds the real kernel.
ADD2_H = textwrap.dedent(
    """
    #pragma once
    void launch_add2(float* c, const float* a, const float* b, int n);
    """
)
ADD2_CPU_KERNEL = textwrap.dedent(
    """
    #include "add2.h"

    void launch_add2(float* c, const float* a, const float* b, int n) {
        for (int i = 0; i < n; ++i) {
            c[i] = a[i] + b[i];
        }
    }
    """
)
ADD2_CHECKS = """
    const torch::Tensor* tensors[] = {&c, &a, &b};
    for (const torch::Tensor* t : tensors) {
        TORCH_CHECK(t->device() == c.device(), "torch_launch_add2: a, b and c must be on one device, got ",
                    t->device(), " and ", c.device());
        TORCH_CHECK(t->scalar_type() == torch::kFloat, "torch_launch_add2: tensors must be float32, got ", t->scalar_type());
        TORCH_CHECK(t->is_contiguous(), "torch_launch_add2: tensors must be contiguous");
        TORCH_CHECK(t->numel() == n, "torch_launch_add2: tensors must have n = ", n, " elements, got ", t->numel());
    }
"""
ADD2_CPP = (
    textwrap.dedent(
        """
        #include <torch/extension.h>
        #include "add2.h"

        void torch_launch_add2(torch::Tensor &c,
                               const torch::Tensor &a,
                               const torch::Tensor &b,
                               int n) {
            TORCH_CHECK(c.is_cpu(), "torch_launch_add2: this build has the CPU launcher, got ", c.device());
        CHECKS
            launch_add2(c.data_ptr<float>(),
                        a.data_ptr<float>(),
                        b.data_ptr<float>(),
                        n);
        }

        PYBIND11_MODULE(MODULE_NAME, m) {
            m.def("torch_launch_add2",
                  &torch_launch_add2,
                  "add2 kernel wrapper");
        }
        """
    )
    .replace("CHECKS", ADD2_CHECKS)
    .replace("MODULE_NAME", "TORCH_EXTENSION_NAME")
)

ADD2_CUDA_H = textwrap.dedent(
    """
    #pragma once
    #include <cuda_runtime.h>
    // The tutorial's launch_add2, plus the stream to launch on and the launch's error.
    cudaError_t launch_add2(float* c, const float* a, const float* b, int n, cudaStream_t stream);
    """
)
ADD2_CU = textwrap.dedent(
    """
    #include "add2.h"

    __global__ void add2_kernel(float* c,
                                const float* a,
                                const float* b,
                                int n) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x;
                i < n; i += gridDim.x * blockDim.x) {
            c[i] = a[i] + b[i];
        }
    }

    cudaError_t launch_add2(float* c, const float* a, const float* b, int n, cudaStream_t stream) {
        if (n == 0) {
            return cudaSuccess;  // a grid of 0 blocks is a launch error
        }
        dim3 grid((n + 1023) / 1024);
        dim3 block(1024);
        add2_kernel<<<grid, block, 0, stream>>>(c, a, b, n);
        return cudaGetLastError();
    }
    """
)
ADD2_CUDA_CPP = textwrap.dedent(
    """
    #include <torch/extension.h>
    #include <ATen/cuda/CUDAContext.h>
    #include <c10/cuda/CUDAGuard.h>
    #include "add2.h"

    void torch_launch_add2(torch::Tensor &c,
                           const torch::Tensor &a,
                           const torch::Tensor &b,
                           int n) {
        TORCH_CHECK(c.is_cuda(), "torch_launch_add2: tensors must be on a CUDA device, got ", c.device());
    CHECKS
        const c10::cuda::CUDAGuard guard(c.device());
        const cudaError_t err = launch_add2(c.data_ptr<float>(),
                                            a.data_ptr<float>(),
                                            b.data_ptr<float>(),
                                            n,
                                            at::cuda::getCurrentCUDAStream());
        TORCH_CHECK(err == cudaSuccess, "torch_launch_add2: kernel launch failed: ", cudaGetErrorString(err));
    }

    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
        m.def("torch_launch_add2",
              &torch_launch_add2,
              "add2 kernel wrapper");
    }
    """
).replace("CHECKS", ADD2_CHECKS)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(d))
    return d


def _folder(root: Path, name: str, files: dict[str, str]) -> Path:
    d = root / name
    d.mkdir()
    for fname, text in files.items():
        (d / fname).write_text(text)
    return d


def _entries(cache: Path, name: str) -> list[Path]:
    return sorted(cache.glob(f"{name}-*[0-9a-f]"))


@pytest.mark.slow  # a torch/extension.h (pybind11) module: the heaviest headers there are
def test_hello_from_a_string_builds_once(pch_cache):
    cache = pch_cache
    module = inline("hello_inline", cpp=HELLO_CPP, functions=["hello"], quiet=True)
    assert module.hello() == "Hello World!"
    assert module.hello.__doc__.strip().endswith("hello")

    [entry] = _entries(cache, "hello_inline")
    marker = entry / "COMPLETE.json"
    print(f"hello module built in {json.loads(marker.read_text())['seconds']} s")
    built_at = marker.stat().st_mtime_ns
    [sources] = (cache / "inline").glob("hello_inline-*")  # the run's cache: the examples' strings are there too
    assert re.fullmatch(r"hello_inline-[0-9a-f]{16}", sources.name)
    assert stat.S_IMODE(sources.stat().st_mode) == 0o700 and stat.S_IMODE(sources.parent.stat().st_mode) == 0o700
    generated = (sources / "hello_inline.cpp").read_text()
    assert "#include <torch/extension.h>" in generated and "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in generated
    source_written_at = (sources / "hello_inline.cpp").stat().st_mtime_ns

    # The same strings again: the same module, and the cache entry untouched (no rebuild, not even a rewrite).
    assert inline("hello_inline", cpp=HELLO_CPP, functions=["hello"], quiet=True) is module
    assert marker.stat().st_mtime_ns == built_at
    assert (sources / "hello_inline.cpp").stat().st_mtime_ns == source_written_at
    assert _entries(cache, "hello_inline") == [entry]

    # A changed string is another build: other sources, another key. Checked without compiling it.
    first = inline_config("hello_inline", cpp=HELLO_CPP, functions=["hello"])
    # Built with the prelude's torch/extension.h precompiled, which the cache keeps for the next string.
    assert first.pch_headers == ("<torch/extension.h>",) and first.pch_units == (sources / "hello_inline.cpp",)
    assert any((p / "pch.h.gch").is_file() for p in cache.glob("pch-*"))
    changed = inline_config("hello_inline", cpp=HELLO_CPP.replace("World", "there"), functions=["hello"])
    assert first.sources[0].parent == sources
    assert changed.sources[0].parent != sources and changed.key() != first.key()
    # So is a docstring, which lives in the generated bindings.
    documented = inline_config("hello_inline", cpp=HELLO_CPP, functions={"hello": 'says "hi" ✓'})
    assert documented.key() != first.key()
    assert r'"says \042hi\042 \342\234\223"' in documented.sources[0].read_text()


def test_torch_library_op_from_a_string(cache):
    lib = inline("opforge_inline_test", cpp=TWICE, implicit_headers=False, quiet=True)
    assert isinstance(lib, Library) and lib.built_now and lib.path.is_file()
    x = torch.randn(5, 7).t()  # non-contiguous
    torch.testing.assert_close(torch.ops.opforge_inline_test.twice(x), 2 * x, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="x must be float32, got Double"):
        torch.ops.opforge_inline_test.twice(x.double())
    again = inline("opforge_inline_test", cpp=TWICE, implicit_headers=False, quiet=True)
    assert not again.built_now and again.path == lib.path


@pytest.mark.slow  # a pybind11 folder built twice (edited in between)
def test_add2_tutorial_folder(tmp_path, pch_cache, seed):
    # torch/extension.h precompiled once for this (two builds of add2.cpp), the inline strings and examples/add2.
    folder = _folder(tmp_path, "add2", {"add2.h": ADD2_H, "add2.cpp": ADD2_CPP, "add2_kernel.cpp": ADD2_CPU_KERNEL})
    module = build_pybind_folder(folder, quiet=True)
    g = torch.Generator().manual_seed(seed)
    n = 4099
    a, b = torch.rand(n, generator=g), torch.rand(n, generator=g)
    c = torch.full((n,), float("nan"))
    assert module.torch_launch_add2(c, a, b, n) is None
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="must have n = 4099 elements, got 4098"):
        module.torch_launch_add2(c, a[1:], b, n)
    # An edited kernel rebuilds, and this process gets the new code although it imported the old one
    # under the same module name (pybind11 would hand back the old module); the old object keeps its code.
    (folder / "add2_kernel.cpp").write_text(ADD2_CPU_KERNEL.replace("a[i] + b[i]", "a[i] - b[i]"))
    edited = build_pybind_folder(folder, quiet=True)
    assert edited is not module
    edited.torch_launch_add2(c, a, b, n)
    torch.testing.assert_close(c, a - b, rtol=0, atol=0)
    module.torch_launch_add2(c, a, b, n)
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    # The header is part of the key too.
    key = pybind_folder_config(folder).key()
    (folder / "add2.h").write_text(ADD2_H + "// edited\n")
    assert pybind_folder_config(folder).key() != key


@pytest.mark.slow  # a pybind11 folder compiled, then its import fails
def test_a_pybind_module_that_needs_a_function_no_source_defines_is_explained(tmp_path, pch_cache):
    """The import of a pybind11 module fails in the loader (undefined symbol): said as
    every route says it, the function demangled and the source that calls it, not
    the loader's mangled name alone."""
    folder = _folder(tmp_path, "add2_undefined", {"add2.h": ADD2_H, "add2.cpp": ADD2_CPP})  # launch_add2 declared, never written
    with pytest.raises(BuildError) as info:
        build_pybind_folder(folder, quiet=True)
    said = str(info.value)
    assert said.startswith(
        "opforge: add2_undefined: the built library needs `launch_add2(float*, float const*, float const*, int)` "
        "(called in add2.cpp), but none of the sources defines it"
    ), said
    assert "_Z11launch_add2" not in said and "PYBIND11_MODULE" not in said, said


def test_hard_coded_module_name_is_refused_before_compiling(tmp_path, cache):
    folder = _folder(
        tmp_path,
        "add2",
        {
            "add2.h": ADD2_H,
            "add2.cpp": ADD2_CPP.replace("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)", "PYBIND11_MODULE(add2, m)"),
            "add2_kernel.cpp": ADD2_CPU_KERNEL,
        },
    )
    with pytest.raises(BuildError) as info:
        build_pybind_folder(folder, quiet=True)
    msg = str(info.value)
    assert (
        "PYBIND11_MODULE(add2, m) in add2.cpp: the module name must be TORCH_EXTENSION_NAME (opforge sets it to the built file's "
        "name); write PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)"
    ) in msg
    assert f"{folder / 'add2.cpp'}:{ADD2_CPP.splitlines().index('PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {') + 1}" in msg
    assert not list(cache.glob("add2-*")), "nothing was built"
    # A commented-out declaration is no declaration; none at all is refused too.
    (folder / "add2.cpp").write_text(ADD2_CPP.replace("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)", "// PYBIND11_MODULE(add2, m)\nvoid f()"))
    with pytest.raises(BuildError, match=r"no PYBIND11_MODULE\(TORCH_EXTENSION_NAME, m\) in "):
        pybind_folder_config(folder)


@pytest.mark.slow  # a torch/extension.h (pybind11) module, compiled up to its error
def test_compile_error_names_the_generated_file_and_the_line_of_the_string(pch_cache):
    broken = "int ok() { return 1; }\nint broken() {\n  return undeclared_name;\n}\n"
    with pytest.raises(BuildError) as info:
        inline("opforge_inline_broken", cpp=broken, quiet=True)
    msg = str(info.value)
    assert msg.startswith("opforge: building opforge_inline_broken failed.\n1 compiler error(s):\n")
    # Line 3 of the string, although the generated file has the header lines before it.
    assert re.search(r"/inline/opforge_inline_broken-[0-9a-f]{16}/opforge_inline_broken\.cpp:3: .undeclared_name. was not declared", msg)


def test_undefined_symbol_is_named(cache):
    # Declared, used, never defined: the link succeeds (a shared library may leave symbols to its loader) and the load fails.
    with pytest.raises(BuildError) as info:
        inline("opforge_inline_undefined", cpp="int missing(int);\nint use() { return missing(1); }\n", implicit_headers=False, quiet=True)
    said = str(info.value)
    assert "opforge: opforge_inline_undefined: the built library needs `missing(int)` (called in opforge_inline_undefined.cpp), " in said
    assert "but none of the sources defines it" in said


def test_bad_arguments_are_refused(tmp_path, cache):
    for bad in ("my-op", "1op", "", "op name", "ops::op"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            inline(bad, cpp=HELLO_CPP, functions=["hello"])
    with pytest.raises(ValueError, match="'hel lo'"):
        inline("hello_inline", cpp=HELLO_CPP, functions=["hel lo"])
    with pytest.raises(ValueError, match="no source"):
        inline("empty")
    with pytest.raises(TypeError, match="write \\['-O2'\\]"):
        inline("hello_inline", cpp=HELLO_CPP, functions=["hello"], extra_cflags="-O2")
    with pytest.raises(BuildError, match="own PYBIND11_MODULE"):
        inline("hello_inline", cpp=HELLO_CPP + "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}", functions=["hello"])
    with pytest.raises(BuildError, match="functions=None builds a TORCH_LIBRARY library"):
        inline("hello_inline", cpp=HELLO_CPP + "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}")
    folder = _folder(tmp_path, "my-op", {"a.cpp": ADD2_CPP})
    with pytest.raises(ValueError, match="'my-op' is not a C identifier; pass name="):
        build_pybind_folder(folder)
    assert not (cache / "inline").exists() or not any((cache / "inline").iterdir()), "nothing written for refused arguments"


def test_cuda_source_with_a_cpu_torch_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch, also on a GPU machine
    with pytest.raises(BuildError) as info:
        inline("square_inline", cpp=SQUARE_CPP, cuda=SQUARE_CUDA, functions=["square_matrix"])
    msg = str(info.value)
    assert "inline('square_inline')" in msg and "CUDA source was given" in msg and "torch.version.cuda is None" in msg
    with pytest.raises(BuildError, match="with_cuda=True"):
        inline("hello_inline", cpp=HELLO_CPP, functions=["hello"], with_cuda=True)


@pytest.mark.cuda
def test_load_inline_tutorial_square_matrix_cuda(cache, seed):
    module = inline("square_inline", cpp=SQUARE_CPP, cuda=SQUARE_CUDA, functions=["square_matrix"], extra_cuda_cflags=["-O2"], quiet=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(37, 53, device="cuda", generator=g)  # neither side a multiple of the 16x16 block
    for m in (x, x.t(), x[:0]):
        torch.testing.assert_close(module.square_matrix(m), m * m, rtol=0, atol=0)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="must be 2-D"):
        module.square_matrix(x[0])


@pytest.mark.cuda
def test_add2_tutorial_folder_cuda(tmp_path, cache, seed):
    folder = _folder(tmp_path, "add2", {"add2.h": ADD2_CUDA_H, "add2.cpp": ADD2_CUDA_CPP, "add2.cu": ADD2_CU})
    module = build_pybind_folder(folder, quiet=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for n in (1024 * 1024 + 3, 0):
        a, b = torch.rand(n, device="cuda", generator=g), torch.rand(n, device="cuda", generator=g)
        c = torch.full((n,), float("nan"), device="cuda")
        module.torch_launch_add2(c, a, b, n)
        torch.cuda.synchronize()
        torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="must be on a CUDA device"):
        module.torch_launch_add2(torch.empty(4), torch.empty(4), torch.empty(4), 4)


def test_a_pybind_folder_unpacked_from_a_source_distribution_is_named_after_its_package(tmp_path, opforge_here):
    """`opforge build NAME-1.2.0` (a source distribution's folder) on the pybind route: the module is
    NAME, not a crash for a folder name that is no C identifier."""
    source = (
        "#include <torch/extension.h>\nint twice(int x) { return 2 * x; }\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }\n'
    )
    folder = _folder(tmp_path, "my-ext-1.2.0", {"ext.cpp": source})
    code, out, err = opforge_here("build", str(folder), "--dry-run")
    assert code == 0, out + err
    assert "pybind" in out + err and "my_ext" in out + err, out + err
