// pin_strategies.cu — ways to pin a large host arena, each phase timed (allocate or first-touch,
// pin, free) and the H2D bandwidth from the result. Standalone (not in CMake):
//   nvcc -O2 -std=c++17 -o /tmp/pin bench/pin_strategies.cu && /tmp/pin 16   # GiB
// Figures in bench/README.md ("How to pin a large host arena").
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
using clk = std::chrono::steady_clock;
static double since(clk::time_point t) {
  return std::chrono::duration<double>(clk::now() - t).count();
}
static void pfill(char* p, size_t n, int th) {
  std::vector<std::thread> ts;
  size_t per = (n / th + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  for (int i = 0; i < th; ++i) {
    size_t b = i * per;
    if (b >= n) break;
    size_t e = std::min(n, b + per);
    ts.emplace_back([=] { std::memset(p + b, 0, e - b); });
  }
  for (auto& t : ts) t.join();
}
static double h2d(char* p) {
  void* d;
  cudaMalloc(&d, 1 << 30);
  cudaMemcpy(d, p, 1 << 30, cudaMemcpyHostToDevice);
  auto t = clk::now();
  cudaMemcpy(d, p, 1 << 30, cudaMemcpyHostToDevice);
  double s = since(t);
  cudaFree(d);
  return (1 << 30) / s / 1e9;
}
int main(int argc, char** argv) {
  size_t G = size_t(1) << 30;
  size_t n = (argc > 1 ? atoi(argv[1]) : 16) * G;
  int th = 16;
  cudaFree(0);
  {
    auto t = clk::now();
    char* p;
    cudaHostAlloc((void**)&p, n, cudaHostAllocPortable);
    double a = since(t);
    t = clk::now();
    pfill(p, n, th);
    double f = since(t);
    double bw = h2d(p);
    t = clk::now();
    cudaFreeHost(p);
    double fr = since(t);
    printf("A hostalloc+pfill: alloc %.2fs fill %.2fs free %.2fs h2d %.1fGB/s\n", a, f, fr, bw);
  }
  for (int huge = 0; huge < 2; ++huge) {
    auto t = clk::now();
    char* p = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (huge) madvise(p, n, MADV_HUGEPAGE);
    pfill(p, n, th);
    double f = since(t);
    t = clk::now();
    cudaError_t e = cudaHostRegister(p, n, cudaHostRegisterPortable);
    double r = since(t);
    double bw = h2d(p);
    t = clk::now();
    cudaHostUnregister(p);
    munmap(p, n);
    double fr = since(t);
    printf("B mmap huge=%d pfill %.2fs register(one) %.2fs err=%d free %.2fs h2d %.1fGB/s\n", huge,
           f, r, (int)e, fr, bw);
  }
  {
    auto t = clk::now();
    char* p = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(p, n, MADV_HUGEPAGE);
    pfill(p, n, th);
    double f = since(t);
    t = clk::now();
    std::vector<std::thread> ts;
    size_t chunks = n / G;
    for (size_t c = 0; c < chunks; ++c)
      ts.emplace_back([=] { cudaHostRegister(p + c * G, G, cudaHostRegisterPortable); });
    for (auto& x : ts) x.join();
    double r = since(t);
    double bw = h2d(p);
    for (size_t c = 0; c < chunks; ++c) cudaHostUnregister(p + c * G);
    munmap(p, n);
    printf("C mmap huge pfill %.2fs register(1GiB chunks, parallel) %.2fs h2d %.1fGB/s\n", f, r,
           bw);
  }
  {
    auto t = clk::now();
    char* p = (char*)mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(p, n, MADV_HUGEPAGE);
    double r = 0;
    // register-then-fill: fill chunk in parallel and register chunks as they finish
    size_t chunks = n / G;
    std::vector<std::thread> ts;
    for (size_t c = 0; c < chunks; ++c)
      ts.emplace_back([=] {
        std::memset(p + c * G, 0, G);
        cudaHostRegister(p + c * G, G, cudaHostRegisterPortable);
      });
    for (auto& x : ts) x.join();
    r = since(t);
    double bw = h2d(p);
    for (size_t c = 0; c < chunks; ++c) cudaHostUnregister(p + c * G);
    munmap(p, n);
    printf("D mmap huge, per-chunk fill+register in 16 threads: %.2fs total h2d %.1fGB/s\n", r, bw);
  }
  {
    auto t = clk::now();
    size_t chunks = n / G;
    std::vector<char*> ps(chunks);
    std::vector<std::thread> ts;
    for (size_t c = 0; c < chunks; ++c)
      ts.emplace_back([&, c] {
        cudaHostAlloc((void**)&ps[c], G, cudaHostAllocPortable);
        std::memset(ps[c], 0, G);
      });
    for (auto& x : ts) x.join();
    double r = since(t);
    printf("E hostalloc 1GiB chunks parallel + fill: %.2fs\n", r);
    for (auto q : ps) cudaFreeHost(q);
  }
  return 0;
}
