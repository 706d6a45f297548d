// embedded_presets.h — the preset files, compiled into the library by cmake/embed_presets.cmake
// (the definitions live in a generated emsa_presets.cc in the build directory). Internal.
#pragma once

#include <cstddef>

namespace emsa::presets_internal {

struct EmbeddedFile {
  const char* kind;  // "models" or "devices": the folder under presets/
  const char* name;  // file name without ".json"
  const unsigned char* data;
  size_t size;  // bytes; data is not NUL-terminated
};

extern const EmbeddedFile kEmbeddedFiles[];
extern const size_t kEmbeddedFileCount;

}  // namespace emsa::presets_internal
