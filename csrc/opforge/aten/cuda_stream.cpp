// The one file of the op library that includes c10/cuda headers: it hands the
// pure-CUDA launchers the current stream as an opaque pointer. Compiled only in
// a CUDA build (the CPU wheel of torch lacks the CUDA config headers).

#include <c10/cuda/CUDAStream.h>

#include "opforge/aten/common.h"

namespace opforge {

void* current_cuda_stream(const at::Device& device) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(device.index()).stream());
}

}  // namespace opforge
