/* emsa_host.h — the C ABI of libemsa, part: the pinned host arena (and its DLPack views) and
 * the host tier for CUDA parameters, which updates on the CPU (emsa_device.h's scalars give
 * it a gated step's verdict). Included by emsa/emsa.h, whose conventions hold here; include
 * that. */
#ifndef EMSA_EMSA_HOST_H_
#define EMSA_EMSA_HOST_H_

#ifndef EMSA_EMSA_H_
#error "include emsa/emsa.h (the whole C ABI), which includes this part"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- pinned host arena --------------------------------------------------------------------- */
typedef struct emsa_host_arena emsa_host_arena;

/* One zero-filled allocation aligned to 2 MiB, populated on every CPU; page-locked
 * (cudaHostRegister, cudaHostAlloc as the fallback) when want_pinned is 1 and a device is
 * usable, otherwise pageable. 0 never touches CUDA. emsa_host_arena_info's pinned_out tells
 * whether it is pinned. A host without room for it fails before anything is allocated
 * (emsa_host_arena_check). emsa_host_arena_create_with may lock only a prefix, and populate the
 * rest in the background. */
EMSA_API emsa_status emsa_host_arena_create(uint64_t bytes, int32_t want_pinned,
                                            emsa_host_arena** arena_out);
EMSA_API void emsa_host_arena_destroy(emsa_host_arena* arena);
EMSA_API emsa_status emsa_host_arena_info(const emsa_host_arena* arena, void** data_out,
                                          uint64_t* bytes_out, int32_t* pinned_out);

/* How a host arena is made (emsa/host_arena.h HostArenaOptions; defaults from
 * emsa_host_arena_options_init). emsa_host_arena_create is emsa_host_arena_create_with with the
 * defaults and its want_pinned. */
typedef struct emsa_host_arena_options {
  uint32_t struct_size;     /* sizeof(emsa_host_arena_options) */
  int32_t want_pinned;      /* 1 (default): page-locked when a CUDA device is usable; 0: never
                             * touches CUDA */
  int32_t fill_threads;     /* threads for the first touch; 0 (default): every CPU this process
                             * may run on; 1: the calling thread */
  int32_t reserved;         /* 0 */
  uint64_t available_bytes; /* host memory the arena may take; 0 (default): MemAvailable now */
  uint64_t locked_bytes;    /* the prefix page-locked when pinned, in whole 2 MiB pages; the rest
                             * is pageable. UINT64_MAX (default): all of it */
  int32_t populate_in_background; /* 1: the part after the locked prefix is populated on a
                                   * thread of the arena's own after creation returns
                                   * (emsa_host_arena_wait_populated); 0 (default): before */
  int32_t reserved2;              /* 0 */
} emsa_host_arena_options;
EMSA_API void emsa_host_arena_options_init(emsa_host_arena_options* options);
/* EMSA_OK when the host can hold an arena of `bytes` now; else the EMSA_OUT_OF_MEMORY that
 * creating it would return, whose message names the largest size that fits. Allocates nothing.
 * options may be NULL (defaults). */
EMSA_API emsa_status emsa_host_arena_check(uint64_t bytes, const emsa_host_arena_options* options);
EMSA_API emsa_status emsa_host_arena_create_with(uint64_t bytes,
                                                 const emsa_host_arena_options* options,
                                                 emsa_host_arena** arena_out);

#define EMSA_HOST_PIN_NONE 0       /* pageable (not asked for, or no device: fallback_reason) */
#define EMSA_HOST_PIN_REGISTERED 1 /* mapped, first-touched, cudaHostRegister'd */
#define EMSA_HOST_PIN_HOST_ALLOC 2 /* cudaHostAlloc: registering failed (fallback_reason) */

/* How an arena was obtained and what it cost (emsa/host_arena.h HostArenaFacts). */
typedef struct emsa_host_arena_facts {
  uint32_t struct_size;           /* sizeof(emsa_host_arena_facts) */
  int32_t pin;                    /* EMSA_HOST_PIN_* */
  int32_t huge_pages;             /* 1: the kernel accepted MADV_HUGEPAGE for the mapping */
  int32_t fill_threads;           /* threads that ran the first touch */
  uint64_t locked_bytes;          /* page-locked */
  uint64_t pageable_bytes;        /* not locked: resident, or populated in the background */
  uint64_t locked_limit_bytes;    /* soft RLIMIT_MEMLOCK, UINT64_MAX unlimited (reported only:
                                   * CUDA's pinning does not count against it) */
  double fill_seconds;            /* populating before creation returned */
  double pin_seconds;             /* cudaHostRegister, or cudaHostAlloc on the fallback */
  double populate_seconds;        /* the background population, once finished (else 0) */
  int32_t populate_in_background; /* 1: the part after the locked prefix is populated in the
                                   * background */
  int32_t populated;              /* 1: every page is resident */
} emsa_host_arena_facts;
EMSA_API void emsa_host_arena_facts_init(emsa_host_arena_facts* facts);
/* facts must be initialized; *fallback_reason_out ("" when none; may be NULL) is freed with
 * emsa_free. */
EMSA_API emsa_status emsa_host_arena_describe(const emsa_host_arena* arena,
                                              emsa_host_arena_facts* facts,
                                              char** fallback_reason_out);
/* Blocks until every page before byte `offset` of the arena is resident (at once where nothing
 * is populated in the background, or it got there); any thread. EMSA_OUT_OF_MEMORY when the
 * kernel could not supply the pages: do not step from the arena then. */
EMSA_API emsa_status emsa_host_arena_wait_populated(const emsa_host_arena* arena, uint64_t offset);
/* A view of the arena as a DLPack tensor, on the terms of emsa_device_arena_export (emsa_device.h:
 * the export keeps the memory alive; emsa_dlpack_delete one never handed to a consumer); views
 * are kDLCPU (pinned or not), which torch accepts. */
EMSA_API emsa_status emsa_host_arena_export(const emsa_host_arena* arena, uint64_t offset,
                                            const int64_t* shape, int32_t ndim, int32_t dtype,
                                            void** dlmanaged_out);

/* ---- host tier for CUDA parameters (emsa/host_tier.h) -------------------------------------- *
 * Gradients down on d2h_stream as each bucket becomes ready, the CPU update on the updater's
 * pool from a worker thread, parameters up on h2d_stream; the compute stream waits only per
 * bucket (emsa_host_tier_wait), never for the whole step. The updater and both streams must
 * outlive the tier, and nothing else may call the updater while the tier exists. */
typedef struct emsa_host_tier emsa_host_tier;

typedef struct emsa_host_tier_tensor {
  uint32_t struct_size; /* sizeof(emsa_host_tier_tensor) */
  /* Host pointers: param is what the CPU update writes (the fp32 master of an fp32 parameter,
   * master NULL; else a bf16/fp16 staging buffer with master the fp32 master, which may be grad
   * itself: the rounded parameter is written over the gradient, and the next step's gradient
   * copy waits for the upload that reads it); grad the staging buffer the gradient is copied
   * into. .step and .hyper are ignored (set per step). */
  emsa_tensor_update update;
  int32_t group;      /* param group */
  int64_t bucket;     /* 0 <= bucket < bucket_count */
  void* device_param; /* where the new parameter is copied (device memory) */
  /* 1: the GPU updates it, its moments brought from and returned to the host arena through
   * device staging (HostTierTensor.device_update; every tensor of its bucket alike; fp32
   * parameter without master, fp32 gradient, fp32 or bf16 moments); 0 (default): the CPU */
  int32_t device_update;
} emsa_host_tier_tensor;

typedef struct emsa_host_tier_options {
  uint32_t struct_size; /* sizeof(emsa_host_tier_options) */
  int32_t optimizer;    /* EMSA_OPTIMIZER_*; default ADAMW */
  int32_t rounding;     /* EMSA_ROUNDING_*; default STOCHASTIC */
  uint64_t seed;        /* stochastic rounding stream; default 0 */
  int32_t device;       /* CUDA device; default 0 */
  /* 1: buckets are submitted from backward, each as its gradients become final; 0 (default):
   * after backward, all at once. A fact about the caller: only from backward are the copies
   * paced (HostTierOptions.submit_in_backward, paced_copies) */
  int32_t submit_in_backward;
  /* 1 (default): for fp32 parameters with fp32 gradients under AdamW or Lion, the CPU writes only
   * the change and the device applies it (HostTierOptions.device_delta), through a device
   * staging buffer of delta_staging_elements floats (default 4 Mi); 0: the CPU updates the host
   * copy of each parameter, which is uploaded */
  int32_t device_delta;
  int64_t delta_staging_elements;
  /* with submit_in_backward, N >= 1 (default 2): the tier's worker enqueues a bucket's gradient
   * copies pace_piece_elements (default 4 Mi, >= 64) at a time, N pieces ahead of the CPU, so
   * they land just before it reads them (HostTierOptions.paced_copies). The caller then keeps
   * each bucket's device gradients until emsa_host_tier_bucket_copies_enqueued says 1. 0, or
   * without submit_in_backward: emsa_host_tier_submit enqueues them whole */
  int32_t paced_copies;
  int64_t pace_piece_elements;
  /* under pacing: at most this many bytes of submitted gradients wait on the device for their
   * copies (-1, the default: no limit); past it a bucket is copied at once */
  int64_t paced_hold_bytes;
  /* device-updated tensors: staging slots of this many elements per moment (default 8 Mi) and
   * how many slots (default 3) (HostTierOptions.stream_piece_elements, stream_slots) */
  int64_t stream_piece_elements;
  int32_t stream_slots;
  /* a cudaStream_t for the device-updated buckets' kernels, the caller's (it must outlive the
   * tier), or NULL (default) for one the tier owns (HostTierOptions.device_update_stream) */
  void* device_update_stream;
  /* 1: every step emsa_host_tier_begin_step starts is gated (waits for emsa_host_tier_release);
   * 0 (default): ungated. emsa_host_tier_begin_step_gated chooses per step instead */
  int32_t gated;
} emsa_host_tier_options;

/* One step's measurements: busy seconds per engine (sums over buckets). */
typedef struct emsa_host_tier_step_stats {
  uint32_t struct_size;   /* sizeof(emsa_host_tier_step_stats) */
  int64_t step;           /* 1-based count of emsa_host_tier_begin_step calls */
  double d2h_s;           /* gradient copies (CUDA events) */
  double cpu_s;           /* CPU updates */
  double h2d_s;           /* parameter copies (CUDA events) */
  double wait_s;          /* host time emsa_host_tier_wait blocked: an upload was not enqueued */
  int64_t buckets;        /* buckets submitted in the step */
  int32_t complete;       /* 1: every submitted bucket's copies have finished and been timed */
  double grad_wait_s;     /* the tier's worker blocked until gradients were final or had landed */
  double worker_s;        /* the worker from taking each bucket to enqueueing its upload */
  int64_t device_buckets; /* device-updated buckets submitted in the step */
  double stream_up_s;     /* their moments' copies up, summed (HostTierStepStats.stream_up_s) */
  int32_t gated;          /* 1: the step waited for a release */
  int32_t skipped;        /* 1: its release said found_inf; nothing was updated */
} emsa_host_tier_step_stats;

EMSA_API void emsa_host_tier_tensor_init(emsa_host_tier_tensor* tensor);
EMSA_API void emsa_host_tier_options_init(emsa_host_tier_options* options);
EMSA_API void emsa_host_tier_step_stats_init(emsa_host_tier_step_stats* stats);
/* The CPU update pool's size for `cores` usable cores (emsa::HostTierThreads): one fewer, at
 * least 1. */
EMSA_API int32_t emsa_host_tier_threads(int32_t cores);
EMSA_API emsa_status emsa_host_tier_create(emsa_cpu_updater* updater,
                                           const emsa_host_tier_tensor* tensors, size_t count,
                                           size_t bucket_count, size_t group_count,
                                           void* d2h_stream, void* h2d_stream,
                                           const emsa_host_tier_options* options,
                                           emsa_host_tier** tier_out);
/* Waits for every submitted bucket, then stops the worker. */
EMSA_API void emsa_host_tier_destroy(emsa_host_tier* tier);
/* Step counts are per tensor, kept by the tier (creation order, 0 at create): a present
 * tensor's update uses its count + 1, and the count advances when a step that was not skipped
 * ends (settled by the next begin_step or by synchronize). */
/* Starts a step (waits until the previous one's CPU updates are done): group_count
 * hyperparameters and step numbers. Sets the count of every tensor of group g to steps[g] - 1
 * (its update then uses steps[g], as before per-tensor counts); gated per options.gated. */
EMSA_API emsa_status emsa_host_tier_begin_step(emsa_host_tier* tier, const emsa_hyperparams* hypers,
                                               const int64_t* steps, size_t group_count);
/* Starts a step with the tier's own per-tensor counts. gated 1: its updates wait for
 * emsa_host_tier_release (or _release_values): gradient copies are enqueued whole at submit, the
 * CPU updates nothing before the verdict, then proceeds as usual; device-updated buckets are
 * enqueued only after it (keep their gradients until emsa_host_tier_bucket_copies_enqueued
 * says 1). 0: as today. EMSA_INVALID_ARGUMENT (nothing changed) if the previous step was gated
 * and never released. */
EMSA_API emsa_status emsa_host_tier_begin_step_gated(emsa_host_tier* tier,
                                                     const emsa_hyperparams* hypers,
                                                     size_t group_count, int32_t gated);
/* The verdict of the current gated step: enqueued on `stream` after the caller's work there
 * (emsa_device_finish_stats), a copy of the scalars' step header into the tier's pinned memory
 * (and its own device copy for device-updated buckets) and an event. Once it has completed:
 * found_inf != 0 -> every bucket of the step is skipped (no update, no upload, state, masters,
 * parameters and step counts untouched); else every update multiplies the gradients by the
 * header's grad_multiplier. Asynchronous. EMSA_INVALID_ARGUMENT if the step is not gated or
 * was released already. */
EMSA_API emsa_status emsa_host_tier_release(emsa_host_tier* tier,
                                            const emsa_device_scalars* scalars, void* stream);
/* The same verdict as values (no device scalars): grad_multiplier finite, found_inf 0 or 1. */
EMSA_API emsa_status emsa_host_tier_release_values(emsa_host_tier* tier, float grad_multiplier,
                                                   int32_t found_inf);
/* Per-tensor step counts, count = the tier's tensor count, creation order. read: as settled
 * (after synchronize for the last step); set (load_state_dict): each >= 0, between steps. */
EMSA_API emsa_status emsa_host_tier_read_steps(const emsa_host_tier* tier, int64_t* out,
                                               size_t count);
EMSA_API emsa_status emsa_host_tier_set_steps(emsa_host_tier* tier, const int64_t* steps,
                                              size_t count);
/* 1: the last step whose verdict is known was skipped (read after synchronize); 0: not, or no
 * such step; -1: tier is NULL. */
EMSA_API int32_t emsa_host_tier_last_skipped(const emsa_host_tier* tier);
/* Bucket `bucket`'s gradients are final on `stream` (device pointers in tensor order; NULL for a
 * tensor with numel > 0: absent this step, not copied, updated or uploaded, its count stays). A
 * bucket whose tensors are all absent need not be submitted. */
EMSA_API emsa_status emsa_host_tier_submit(emsa_host_tier* tier, size_t bucket,
                                           const void* const* grads, size_t count, void* stream);
/* `stream` waits for bucket `bucket`'s new parameters (EMSA_INVALID_ARGUMENT before the release
 * of its gated step: it would never return). */
EMSA_API emsa_status emsa_host_tier_wait(emsa_host_tier* tier, size_t bucket, void* stream);
/* `stream` waits until this step's gradient copies are done (before writing gradients). */
EMSA_API emsa_status emsa_host_tier_wait_grads_copied(emsa_host_tier* tier, void* stream);
/* The host waits until every submitted bucket is updated and its parameters are uploaded
 * (EMSA_INVALID_ARGUMENT, without waiting, in a gated step not yet released). */
EMSA_API emsa_status emsa_host_tier_synchronize(emsa_host_tier* tier);
/* How many buckets' gradient copies have been enqueued since creation (-1: tier is NULL): a
 * cheap poll for a change before asking per bucket. */
EMSA_API int64_t emsa_host_tier_copies_enqueued(const emsa_host_tier* tier);
/* The stream (a cudaStream_t) the device-updated buckets' kernels run on, NULL when there are
 * none or tier is NULL: their gradients must stay alive in its order. */
EMSA_API void* emsa_host_tier_update_stream(const emsa_host_tier* tier);
/* Device bytes of the staging for device-updated tensors under these options, moments of
 * state_dtype (EMSA_DTYPE_*), the largest such tensor `largest` elements; -1 for a NULL or
 * uninitialized options, a bad dtype or largest < 1. */
EMSA_API int64_t emsa_host_tier_stream_staging_bytes(const emsa_host_tier_options* options,
                                                     int32_t state_dtype, int64_t largest);
/* 1: every gradient copy of the bucket's last submit is enqueued (under pacing its device
 * gradients may be released now; the stream order keeps them until read), or the tier failed;
 * 0: not yet; -1: tier NULL or no such bucket. */
EMSA_API int32_t emsa_host_tier_bucket_copies_enqueued(const emsa_host_tier* tier, size_t bucket);
/* The current step's host timeline, one entry per bucket (count = bucket_count), seconds since
 * its begin_step, -1 where not reached yet: submitted, CPU update started and ended. */
EMSA_API emsa_status emsa_host_tier_trace(const emsa_host_tier* tier, double* submit, double* start,
                                          double* end, size_t count);
/* Steps >= first (oldest kept first), at most capacity; *count_out receives how many. */
EMSA_API emsa_status emsa_host_tier_stats(const emsa_host_tier* tier, int64_t first,
                                          emsa_host_tier_step_stats* out, size_t capacity,
                                          size_t* count_out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EMSA_EMSA_HOST_H_ */
