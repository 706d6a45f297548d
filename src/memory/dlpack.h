/* dlpack.h — the DLPack C ABI, declared here from the DLPack specification (dmlc.github.io/dlpack).
 *
 * Only what emsa exports: DLDevice, DLDataType, DLTensor and the unversioned DLManagedTensor
 * (DLPack 0.x), the struct that torch.from_dlpack accepts inside a PyCapsule named "dltensor".
 * The layout is the ABI, so it is checked below with static assertions; names follow the spec so
 * that readers can match fields against it. Plain C, so the C ABI tests can include it too.
 */
#ifndef EMSA_MEMORY_DLPACK_H_
#define EMSA_MEMORY_DLPACK_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where the memory lives. Values are fixed by the spec; only the ones emsa uses are named.
 * torch.from_dlpack rejects kDLCUDAHost: export pinned host memory as kDLCPU for torch. */
typedef enum {
  kDLCPU = 1,      /* host memory, pageable or pinned; device_id 0 */
  kDLCUDA = 2,     /* CUDA device memory; device_id is the CUDA ordinal */
  kDLCUDAHost = 3, /* pinned host memory (cudaMallocHost), for consumers that want the hint */
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

/* Type codes fixed by the spec. float32 is (kDLFloat, 32, 1), float16 (kDLFloat, 16, 1),
 * bfloat16 (kDLBfloat, 16, 1). */
typedef enum {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
} DLDataTypeCode;

typedef struct {
  uint8_t code;   /* a DLDataTypeCode */
  uint8_t bits;   /* bits per lane */
  uint16_t lanes; /* 1 for scalars */
} DLDataType;

/* A strided view; it owns nothing. Strides count elements, not bytes. */
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;       /* ndim entries */
  int64_t* strides;     /* ndim entries; older specs allowed NULL (row-major), emsa fills it */
  uint64_t byte_offset; /* added to data by the consumer */
} DLTensor;

/* A DLTensor plus the means to give it back. The consumer (torch) calls deleter(self) exactly
 * once, when it no longer needs the memory; manager_ctx belongs to the producer. */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

#ifdef __cplusplus
}  // extern "C"

// The LP64 layout every DLPack consumer on Linux x86-64 and aarch64 expects.
static_assert(sizeof(DLDevice) == 8, "DLDevice layout");
static_assert(sizeof(DLDataType) == 4, "DLDataType layout");
static_assert(offsetof(DLTensor, device) == 8 && offsetof(DLTensor, ndim) == 16 &&
                  offsetof(DLTensor, dtype) == 20 && offsetof(DLTensor, shape) == 24 &&
                  offsetof(DLTensor, strides) == 32 && offsetof(DLTensor, byte_offset) == 40 &&
                  sizeof(DLTensor) == 48,
              "DLTensor layout");
static_assert(offsetof(DLManagedTensor, manager_ctx) == 48 &&
                  offsetof(DLManagedTensor, deleter) == 56 && sizeof(DLManagedTensor) == 64,
              "DLManagedTensor layout");
#endif

#endif /* EMSA_MEMORY_DLPACK_H_ */
