// Runs an AOTInductor package made by opforge.export.package, without Python.
//
//   deploy_runner MODEL.pt2 IO_PREFIX OUT_DIR [cpu|cuda] LIBRARY.so...
//
// LIBRARY.so: the package's op libraries and its C shim library (the files
// under <name>/opforge/ in the archive, listed in its manifest.json), in any
// order. Each is loaded before the model: an op library registers its
// operators with the dispatcher, and the compiled model was linked against the
// shim library, which the loader finds already loaded by its soname.
//
// IO_PREFIX.io.txt lists the inputs, one a line, "name dtype d0 d1 ..."
// (lines whose name starts with "out" are the expected outputs, skipped); each
// input's values are IO_PREFIX.<name>.bin, raw and row-major. Each output i is
// written to OUT_DIR/out<i>.bin the same way, and its dtype and shape printed.

#include <dlfcn.h>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

const std::map<std::string, at::ScalarType> kDtypes = {
    {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}, {"float64", at::kDouble},
    {"int8", at::kChar},     {"int32", at::kInt},    {"int64", at::kLong},
};

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : kDtypes) {
    if (type == t) return name;
  }
  return c10::toString(t);
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::vector<at::Tensor> read_inputs(const std::string& prefix, const at::Device& device) {
  std::ifstream list(prefix + ".io.txt");
  if (!list) throw std::runtime_error("cannot read " + prefix + ".io.txt");
  std::vector<at::Tensor> inputs;
  for (std::string line; std::getline(list, line);) {
    std::istringstream words(line);
    std::string name, dtype;
    words >> name >> dtype;
    if (name.empty() || name.rfind("out", 0) == 0) continue;
    auto type = kDtypes.find(dtype);
    if (type == kDtypes.end()) throw std::runtime_error(prefix + ".io.txt: unknown dtype " + dtype + " of " + name);
    std::vector<int64_t> shape;
    for (int64_t d; words >> d;) shape.push_back(d);
    std::vector<char> bytes = read_file(prefix + "." + name + ".bin");
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type->second));
    if (static_cast<size_t>(t.nbytes()) != bytes.size()) {
      throw std::runtime_error(name + ": " + std::to_string(bytes.size()) + " bytes for " + std::to_string(t.nbytes()));
    }
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    inputs.push_back(t.to(device));
  }
  return inputs;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt2 IO_PREFIX OUT_DIR cpu|cuda [LIBRARY.so...]\n";
    return 2;
  }
  const std::string package = argv[1], prefix = argv[2], out_dir = argv[3];
  const at::Device device(argv[4]);
  for (int i = 5; i < argc; ++i) {
    // RTLD_GLOBAL: the compiled model resolves the shim functions against it.
    if (dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "deploy_runner: cannot load " << argv[i] << ": " << dlerror() << "\n";
      return 1;
    }
  }
  try {
    torch::inductor::AOTIModelPackageLoader loader(package);
    std::vector<at::Tensor> outputs = loader.run(read_inputs(prefix, device));
    for (size_t i = 0; i < outputs.size(); ++i) {
      at::Tensor t = outputs[i].contiguous().cpu();
      std::ofstream f(out_dir + "/out" + std::to_string(i) + ".bin", std::ios::binary);
      f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
      std::cout << "out" << i << " " << dtype_name(t.scalar_type());
      for (int64_t d : t.sizes()) std::cout << " " << d;
      std::cout << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "deploy_runner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
