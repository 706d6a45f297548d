// EMSA_HD: a function valid as host and device code (inline on the host, __host__ __device__
// under nvcc). Headers whose arithmetic both paths share include this one definition.
#pragma once

#if !defined(EMSA_HD)
#if defined(__CUDACC__)
#define EMSA_HD __host__ __device__ __forceinline__
#else
#define EMSA_HD inline
#endif
#endif
