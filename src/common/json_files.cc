// json_files.cc — json::ReadFile (bounded) and json::WriteFile (atomic) of src/common/json.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "common/json.h"
#include "emsa/types.h"

namespace emsa::json {

Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return Status::IoError("cannot open '" + path + "' for reading: " + std::strerror(errno));
  auto too_large = [&] {
    return Status::IoError("'" + path + "' is larger than " + FormatBytes(max_bytes) +
                           ", the most emsa reads of a JSON file");
  };
  struct stat st {};
  const bool sized = ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  if (sized && static_cast<uint64_t>(st.st_size) > max_bytes) return too_large();
  // Streams and devices have no size: read in chunks and stop past the limit. A file's size is
  // reserved up front, so the text is held once rather than copied as it grows.
  std::string text;
  if (sized) text.reserve(static_cast<size_t>(st.st_size));
  char chunk[1 << 16];
  while (in) {
    in.read(chunk, sizeof chunk);
    const auto got = static_cast<size_t>(in.gcount());
    if (text.size() + got > max_bytes) return too_large();
    text.append(chunk, got);
  }
  if (in.bad()) return Status::IoError("error while reading '" + path + "'");
  return text;
}

namespace {

Status WriteAll(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IoError(std::strerror(errno));
    text.remove_prefix(static_cast<size_t>(n));
  }
  return Status::Ok();
}

// Writes each piece `produce` emits to fd; the first failure stops the writing and is returned.
Status WritePieces(int fd, const Producer& produce) {
  Status s = Status::Ok();
  produce([&](std::string_view piece) {
    if (s.ok()) s = WriteAll(fd, piece);
  });
  return s;
}

// A target that exists and is not a regular file (a terminal, /dev/null, a pipe) is written in
// place: renaming over it would replace the device rather than write to it.
Status WriteInPlace(const std::string& path, const Producer& produce) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) {
    return Status::IoError("cannot open '" + path + "' for writing: " + std::strerror(errno));
  }
  Status s = WritePieces(fd, produce);
  ::close(fd);
  if (!s.ok()) return Status::IoError("error while writing '" + path + "': " + s.message());
  return Status::Ok();
}

}  // namespace

Status WriteFile(const std::string& path, std::string_view text) {
  return WriteFile(path, [text](const std::function<void(std::string_view)>& emit) { emit(text); });
}

Status WriteFile(const std::string& path, const Producer& produce) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return WriteInPlace(path, produce);
  static std::atomic<unsigned> counter{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    return Status::IoError("cannot open '" + path + "' for writing: cannot create '" + tmp +
                           "': " + std::strerror(errno));
  }
  Status s = WritePieces(fd, produce);
  if (s.ok() && ::fsync(fd) != 0) s = Status::IoError(std::strerror(errno));
  if (::close(fd) != 0 && s.ok()) s = Status::IoError(std::strerror(errno));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = Status::IoError(std::strerror(errno));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return Status::IoError("error while writing '" + path + "': " + s.message());
  }
  return Status::Ok();
}

}  // namespace emsa::json
