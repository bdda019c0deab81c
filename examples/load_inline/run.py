"""The load_inline tutorial's two load_inline programs, through opforge's inline route: the C++
``hello`` and ``square_matrix`` (a CUDA kernel on a GPU, a C++ loop on the CPU),
built as one module by ``opforge.builder.inline.inline``.

    python examples/load_inline/run.py                 # the GPU if torch sees one, else the CPU
    python examples/load_inline/run.py --device cpu

Exits 1 when a check fails.
"""

import argparse
import os
import sys
import types

# This example builds its own module; opforge's op library is not needed, so
# importing opforge does not build or load it.
os.environ.setdefault("OPFORGE_NO_AUTOLOAD", "1")

import torch

from opforge.builder.errors import BuildError
from opforge.builder.inline import inline, inline_config

# The load_inline tutorial's first program, unchanged: inline prepends #include <torch/extension.h>, as load_inline does.
HELLO_CPP = """
std::string hello() {
  return "Hello World!";
}
"""

# The CUDA side of square_matrix. Besides the tutorial's kernel (one thread per
# element of a 2-D grid of 16 x 16 blocks), the wrapper checks what the kernel
# assumes, runs on the input's GPU and on torch's current stream, skips the
# launch for an empty matrix (a grid of 0 blocks is an error) and checks the launch.
SQUARE_CUDA = """
#include <climits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

__global__ void square_matrix_kernel(const float* matrix, float* result, int width, int height) {
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < height && col < width) {
        const int idx = row * width + col;
        result[idx] = matrix[idx] * matrix[idx];
    }
}

torch::Tensor square_matrix(torch::Tensor matrix) {
    TORCH_CHECK(matrix.is_cuda(), "square_matrix: this build squares CUDA tensors, got one on ", matrix.device());
    TORCH_CHECK(matrix.dim() == 2, "square_matrix: the matrix must be 2-D, got ", matrix.dim(), "-D");
    TORCH_CHECK(matrix.scalar_type() == torch::kFloat, "square_matrix: the matrix must be float32, got ", matrix.scalar_type());
    TORCH_CHECK(matrix.numel() <= INT_MAX, "square_matrix: at most 2^31 - 1 elements (int indices), got ", matrix.numel());
    const c10::cuda::CUDAGuard guard(matrix.device());
    const torch::Tensor input = matrix.contiguous();  // the kernel indexes row * width + col
    torch::Tensor result = torch::empty_like(input);
    const int height = static_cast<int>(input.size(0));
    const int width = static_cast<int>(input.size(1));
    if (result.numel() == 0) {
        return result;
    }
    const dim3 threads_per_block(16, 16);
    const dim3 number_of_blocks((width + threads_per_block.x - 1) / threads_per_block.x,
                                (height + threads_per_block.y - 1) / threads_per_block.y);
    square_matrix_kernel<<<number_of_blocks, threads_per_block, 0, at::cuda::getCurrentCUDAStream()>>>(
        input.data_ptr<float>(), result.data_ptr<float>(), width, height);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return result;
}
"""

# What the C++ string declares when the CUDA string defines square_matrix (as in the tutorial).
SQUARE_DECLARATION = """
torch::Tensor square_matrix(torch::Tensor matrix);
"""

# The CPU stand-in: same name, same checks and result, the kernel's body run for every (row, col) by two loops.
SQUARE_CPU = """
torch::Tensor square_matrix(torch::Tensor matrix) {
    TORCH_CHECK(matrix.is_cpu(), "square_matrix: this build squares CPU tensors, got one on ", matrix.device());
    TORCH_CHECK(matrix.dim() == 2, "square_matrix: the matrix must be 2-D, got ", matrix.dim(), "-D");
    TORCH_CHECK(matrix.scalar_type() == torch::kFloat, "square_matrix: the matrix must be float32, got ", matrix.scalar_type());
    const torch::Tensor input = matrix.contiguous();
    torch::Tensor result = torch::empty_like(input);
    const int64_t height = input.size(0);
    const int64_t width = input.size(1);
    const float* in = input.data_ptr<float>();
    float* out = result.data_ptr<float>();
    for (int64_t row = 0; row < height; ++row) {
        for (int64_t col = 0; col < width; ++col) {
            const int64_t idx = row * width + col;
            out[idx] = in[idx] * in[idx];
        }
    }
    return result;
}
"""

FUNCTIONS = {"hello": "Returns 'Hello World!'", "square_matrix": "The element-wise square of a 2-D float32 matrix"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU")
    return args


def build(device: torch.device) -> types.ModuleType:
    """One module with both functions. On a GPU square_matrix comes from the CUDA
    string; on the CPU that string cannot be built (no GPU to run it, and often a
    CPU build of torch with no CUDA headers), so the C++ string carries a CPU one."""
    if device.type == "cuda":
        print("square_matrix: from the CUDA string (nvcc), declared in the C++ string")
        module = inline("load_inline_example", cpp=HELLO_CPP + SQUARE_DECLARATION, cuda=SQUARE_CUDA, functions=FUNCTIONS, verbose=True)
    else:
        if torch.version.cuda is None:
            # What asking for the CUDA string gets here: refused before any compiler runs.
            try:
                inline_config("load_inline_example", cpp=HELLO_CPP + SQUARE_DECLARATION, cuda=SQUARE_CUDA, functions=FUNCTIONS)
            except BuildError as exc:
                print(f"inline(..., cuda=SQUARE_CUDA) here: {exc}")
        why = "this torch is a CPU build" if torch.version.cuda is None else "--device cpu"
        print(f"square_matrix: the CUDA string is not built ({why}); the C++ string carries a CPU implementation")
        module = inline("load_inline_example", cpp=HELLO_CPP + SQUARE_CPU, functions=FUNCTIONS, verbose=True)
    assert isinstance(module, types.ModuleType)  # functions= gives a Python module
    return module


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(f"device: {device}, torch {torch.__version__}")
    ext = build(device)
    failures = []

    greeting = ext.hello()
    print(f"hello() -> {greeting!r}")
    if greeting != "Hello World!":
        failures.append(f"hello() returned {greeting!r}")

    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=device)
    squared = ext.square_matrix(a)
    print(f"square_matrix({a.tolist()}) ->\n{squared}")
    if not torch.equal(squared, torch.tensor([[1.0, 4.0, 9.0], [16.0, 25.0, 36.0]], device=device)):
        failures.append("square_matrix of the tutorial's matrix is wrong")

    # Sizes that are not multiples of the 16 x 16 block, a transposed (non-contiguous) view, an empty matrix.
    gen = torch.Generator(device=device).manual_seed(0)
    big = torch.randn(37, 53, device=device, generator=gen)
    for desc, m in (("37 x 53", big), ("53 x 37, transposed view", big.t()), ("0 x 5", torch.empty(0, 5, device=device))):
        ok = torch.equal(ext.square_matrix(m), m * m)
        print(f"check: square_matrix == m * m for {desc}: {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(f"square_matrix differs from m * m for {desc}")

    for desc, bad in (("a 1-D tensor", torch.ones(4, device=device)), ("float64", torch.ones(2, 2, device=device, dtype=torch.float64))):
        try:
            ext.square_matrix(bad)
            failures.append(f"square_matrix accepted {desc}")
        except RuntimeError as exc:
            print(f"check: {desc} is refused: {str(exc).splitlines()[0]}")

    if failures:
        print(f"\nFAILED: {'; '.join(failures)}")
        return 1
    print("\nload_inline: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
