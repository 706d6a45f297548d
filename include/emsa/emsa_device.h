/* emsa_device.h — the C ABI of libemsa, part: the device tier (fused CUDA updates, their
 * scalars and step header, per-tensor steps and the split step) and the device arena with
 * its DLPack views. Included by emsa/emsa.h, whose conventions hold here; include that. */
#ifndef EMSA_EMSA_DEVICE_H_
#define EMSA_EMSA_DEVICE_H_

#ifndef EMSA_EMSA_H_
#error "include emsa/emsa.h (the whole C ABI), which includes this part"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- device tier: fused CUDA updates ------------------------------------------------------- */
/* Without a CUDA build or a usable device, the create calls return EMSA_UNSUPPORTED.
 * Streams are cudaStream_t passed as void* (NULL = the legacy default stream); every call below
 * but the *_read and *_create ones is asynchronous on that stream and never synchronizes.
 * The device pointers in emsa_tensor_update are recorded at table creation and must stay
 * allocated at those addresses; .hyper and .step are ignored there: the values come from the
 * scalars' param groups (groups[i] names tensor i's group). */
typedef struct emsa_device_scalars emsa_device_scalars;
typedef struct emsa_device_table emsa_device_table;

typedef struct emsa_device_table_options {
  uint32_t struct_size; /* sizeof(emsa_device_table_options) */
  int32_t optimizer;    /* EMSA_OPTIMIZER_*; default ADAMW */
  int32_t rounding;     /* EMSA_ROUNDING_*; default STOCHASTIC */
  int32_t bulk_copy;    /* 1 (default): fp32 tables on sm_90+ move tiles by bulk copies; 0: not */
  /* 1: a table for gradient statistics only (DeviceTableOptions.stats_only): each tensor needs
   * only grad, numel and grad_dtype (param, state and master may be NULL and are not read);
   * emsa_device_table_accumulate_stats and emsa_device_table_set_grads work on it, an update
   * returns EMSA_INVALID_ARGUMENT. 0 (default): an update table */
  int32_t stats_only;
} emsa_device_table_options;

/* What the last step saw; read back for reports and tests (synchronizes the stream). */
typedef struct emsa_device_step_report {
  uint32_t struct_size;  /* sizeof(emsa_device_step_report) */
  int32_t found_inf;     /* nonzero: the update was skipped */
  float grad_multiplier; /* what the update multiplied gradients by */
  float clip_coef;
  double sum_sq;    /* sum of squares of the raw (still scaled) gradients */
  double grad_norm; /* global L2 norm of the unscaled gradients */
  int64_t nonfinite_count;
} emsa_device_step_report;

EMSA_API void emsa_device_table_options_init(emsa_device_table_options* options);
EMSA_API void emsa_device_step_report_init(emsa_device_step_report* report);

/* One record per param group, initialized from groups[i] with step 0. Synchronous. */
EMSA_API emsa_status emsa_device_scalars_create(const emsa_hyperparams* groups, size_t count,
                                                emsa_device_scalars** scalars_out);
EMSA_API void emsa_device_scalars_destroy(emsa_device_scalars* scalars);
/* Sets group `group`'s hyperparameters and step (lr from a scheduler, say). */
EMSA_API emsa_status emsa_device_scalars_set_group(emsa_device_scalars* scalars, size_t group,
                                                   const emsa_hyperparams* hyper, int64_t step,
                                                   void* stream);
/* Per-step inputs: grad_unscale = 1/loss_scale (1 without AMP); max_norm <= 0: no clipping. */
EMSA_API emsa_status emsa_device_scalars_set_inputs(emsa_device_scalars* scalars,
                                                    float grad_unscale, float max_norm,
                                                    uint64_t seed, void* stream);
/* One whole step over `count` tables: begin, gradient statistics (only when check_stats is
 * nonzero: for clipping or the non-finite skip), finish, advance the steps, update each table.
 * No host synchronization. */
EMSA_API emsa_status emsa_device_step(emsa_device_scalars* scalars, emsa_device_table** tables,
                                      size_t count, int32_t check_stats, void* stream);
EMSA_API emsa_status emsa_device_scalars_read(const emsa_device_scalars* scalars,
                                              emsa_device_step_report* report, void* stream);
/* Updates one table with the scalars as they stand: no begin, statistics or group step advance
 * (a table made with slots advances its present tensors' slot steps itself, unless found_inf).
 * For updates made per bucket as gradients become ready (step in backward): call
 * emsa_device_step(scalars, NULL, 0, 0, stream) once per step first (it begins the step and
 * advances the step counts), then this once per table. Asynchronous on `stream`.
 * EMSA_INVALID_ARGUMENT for a stats_only table. */
EMSA_API emsa_status emsa_device_table_update(emsa_device_table* table,
                                              const emsa_device_scalars* scalars, void* stream);

EMSA_API emsa_status emsa_device_table_create(const emsa_tensor_update* tensors,
                                              const int32_t* groups, size_t count,
                                              const emsa_device_table_options* options,
                                              emsa_device_table** table_out);
EMSA_API void emsa_device_table_destroy(emsa_device_table* table);
/* Elements, kernel launches per update, and bytes read+written per update (the time floor). */
EMSA_API emsa_status emsa_device_table_info(const emsa_device_table* table, int64_t* numel_out,
                                            int32_t* launches_out, uint64_t* bytes_out);

/* ---- device tier: what a framework needs per step ------------------------------------------ */
/* The device-side step header, byte for byte (56 bytes; the layout is fixed). */
typedef struct emsa_device_step_header {
  float grad_multiplier; /* what the update multiplies gradients by */
  int32_t found_inf;     /* nonzero: the last step was skipped (a non-finite gradient) */
  float grad_unscale;    /* input: 1 / loss_scale */
  float max_norm;        /* input: clip threshold; <= 0: none */
  uint64_t seed;         /* input: stochastic-rounding stream */
  double sum_sq;
  int64_t nonfinite_count;
  double grad_norm;
  float clip_coef;
  int32_t reserved;
} emsa_device_step_header;

/* Group `group`'s hyperparameters; its step stays as the device counts it (it does not advance
 * on a skipped step, which the host learns only later). Asynchronous. */
EMSA_API emsa_status emsa_device_scalars_set_hyper(emsa_device_scalars* scalars, size_t group,
                                                   const emsa_hyperparams* hyper, void* stream);
/* Every group's step count after the stream's earlier work; count must be the number of
 * groups. Synchronizes the stream. */
EMSA_API emsa_status emsa_device_scalars_read_steps(const emsa_device_scalars* scalars,
                                                    int64_t* steps_out, size_t count, void* stream);
/* Enqueues a copy of the step header into dst (pinned host memory or device memory) and
 * returns without waiting: read dst once an event recorded on the stream after this call has
 * completed. The way to learn whether a step was skipped without making the step wait. */
EMSA_API emsa_status emsa_device_scalars_copy_header(const emsa_device_scalars* scalars,
                                                     emsa_device_step_header* dst, void* stream);
/* The device address of the step header (device memory, valid until the scalars are destroyed),
 * for a framework that combines its fields with its own collectives on the step's stream: e.g.
 * an all-reduce (sum) of sum_sq and nonfinite_count over the ranks that each hold part of the
 * gradients, between emsa_device_table_accumulate_stats and emsa_device_finish_stats, so that
 * every rank clips by the global norm and skips together. Nothing is enqueued. */
EMSA_API emsa_status emsa_device_scalars_header_address(const emsa_device_scalars* scalars,
                                                        emsa_device_step_header** header_out);
/* Points the table at new gradients: grads[i] for tensor i in creation order, count = the
 * table's tensor count, each of the dtype and size given at creation. Asynchronous and
 * allocation-free (pinned staging made at creation; the host waits only when several earlier
 * calls are still queued on the device); pointers equal to the current ones enqueue nothing.
 * Misaligned gradients are handled (scalar path). The pointers are not checked to be device
 * memory: pass what emsa_device_table_create would accept.
 * grads[i] NULL for a tensor with numel > 0: the tensor is ABSENT (its parameter got no
 * gradient): updates and statistics skip it (its gradient is not read; param, moments, master
 * and slot step stay as they are) until a later call gives it a pointer again. A tensor with
 * numel 0 is never absent (it has nothing to read; its slot step advances with every update). */
EMSA_API emsa_status emsa_device_table_set_grads(emsa_device_table* table, const void* const* grads,
                                                 size_t count, void* stream);

/* ---- device tier: per-tensor steps, the split step, loss scale from the device ------------ */
/* Scalars with slot_count per-tensor ("slot") step counts besides the groups, every one 0.
 * A table created with slots (below) reads and advances its tensors' slot steps instead of
 * their group's step (torch keeps one step per parameter: a parameter skipped in a step keeps
 * its count). slot_count 0 is emsa_device_scalars_create. Synchronous. */
EMSA_API emsa_status emsa_device_scalars_create_slots(const emsa_hyperparams* groups,
                                                      size_t group_count, size_t slot_count,
                                                      emsa_device_scalars** scalars_out);
/* emsa_device_table_create with slots[i] tensor i's slot: 0 <= slots[i] < slot_count, no two
 * tensors of the table in one slot (checked here). slot_count is the count of the scalars the
 * table will be used with (an update with scalars of fewer slots is refused). groups may be NULL
 * (every tensor in group 0; the group still gives the hyperparameters).
 * Each update of such a table, unless found_inf: every present (non-absent) tensor's slot step
 * advances by one, then the tensor updates with that step (bias correction and rounding keys);
 * absent tensors: nothing. The advance is a small kernel on the update's stream before the update
 * kernels, so the update also writes the scalars (its slots only): a slot must be updated by at
 * most one table per step (the caller's rule). Group steps are not read (emsa_device_step still
 * advances them). A table whose tensors share one step gives the bits of a table without slots. */
EMSA_API emsa_status emsa_device_table_create_slots(const emsa_tensor_update* tensors,
                                                    const int32_t* groups, const int64_t* slots,
                                                    size_t count, size_t slot_count,
                                                    const emsa_device_table_options* options,
                                                    emsa_device_table** table_out);
/* Every slot's step after the stream's earlier work; count must be the scalars' slot_count.
 * Synchronizes the stream. */
EMSA_API emsa_status emsa_device_scalars_read_slot_steps(const emsa_device_scalars* scalars,
                                                         int64_t* steps_out, size_t count,
                                                         void* stream);
/* Sets every slot's step (load_state_dict): count = slot_count, each >= 0. Ordered on the stream
 * after its earlier work; the values are copied before return (it synchronizes the stream). */
EMSA_API emsa_status emsa_device_scalars_set_slot_steps(emsa_device_scalars* scalars,
                                                        const int64_t* steps, size_t count,
                                                        void* stream);
/* The step split, so that statistics can be gathered while backward runs (all asynchronous,
 * no host synchronization, one tiny kernel or one launch each, ordered on the one stream):
 *   begin_step: grad_multiplier = grad_unscale, found_inf = (grad_unscale not finite: see
 *     set_unscale_from), sum_sq = nonfinite_count = grad_norm = 0, clip_coef = 1;
 *   table_accumulate_stats: adds one table's sum of squares and non-finite count (absent
 *     tensors skipped; update and stats_only tables alike);
 *   finish_stats: found_inf |= any non-finite gradient; grad_norm = sqrt(sum_sq) * |unscale|;
 *     clip_coef = min(1, max_norm / (grad_norm + 1e-6)) when max_norm > 0 and finite, in double,
 *     rounded once (as torch.nn.utils.clip_grad_norm_); grad_multiplier = unscale * clip_coef;
 *   then emsa_device_table_update per table, or emsa_device_finish_step for a list.
 * begin_step does not advance group steps; emsa_device_finish_step does (as emsa_device_step). */
EMSA_API emsa_status emsa_device_begin_step(emsa_device_scalars* scalars, void* stream);
EMSA_API emsa_status emsa_device_table_accumulate_stats(emsa_device_table* table,
                                                        emsa_device_scalars* scalars, void* stream);
EMSA_API emsa_status emsa_device_finish_stats(emsa_device_scalars* scalars, void* stream);
/* finish_stats, advance the group steps (unless found_inf), then update each of `count` tables
 * (slot tables advance their own slots). emsa_device_step is begin_step + accumulate_stats of
 * each table (check_stats) + this. */
EMSA_API emsa_status emsa_device_finish_step(emsa_device_scalars* scalars,
                                             emsa_device_table** tables, size_t count,
                                             void* stream);
/* Loss scale from device memory: enqueues a tiny kernel that sets grad_unscale =
 * (float)(1.0 / (double)*device_scale), reading the float32 at device_scale (e.g. GradScaler's
 * _scale) when the stream reaches it; the value torch's GradScaler unscales by. Call it before
 * begin_step (which copies grad_unscale into grad_multiplier). A scale that is not finite, or
 * <= 0, or whose reciprocal is not finite sets grad_unscale to NaN instead, and the next
 * begin_step then sets found_inf: the step is skipped (nothing updated, no step advanced) rather
 * than dividing into garbage; every begin_step skips until set_inputs or set_unscale_from gives a
 * usable value. device_scale must stay allocated until the stream has run it. */
EMSA_API emsa_status emsa_device_scalars_set_unscale_from(emsa_device_scalars* scalars,
                                                          const float* device_scale, void* stream);
/* Enqueues a tiny kernel writing 1.0f (found_inf set) or 0.0f into the float32 at device_dst
 * (device memory, e.g. GradScaler's per-device found_inf), after the stream's earlier work. */
EMSA_API emsa_status emsa_device_scalars_write_found_inf(const emsa_device_scalars* scalars,
                                                         float* device_dst, void* stream);

/* ---- device arena and DLPack views ---------------------------------------------------------- */
/* One zero-filled device allocation on CUDA device `device`, aligned to 2 MiB (emsa/
 * device_arena.h). Views are exported as DLPack tensors (DLManagedTensor*, DLPack 0.x, passed as
 * void*): contiguous, row-major, `dtype` (EMSA_DTYPE_*), starting `offset` bytes in. Each export
 * keeps the arena's memory alive until its deleter runs, so destroy the handle whenever emsa is
 * done with it: the memory is freed when the handle and every export are gone. A consumer (torch.
 * from_dlpack on a PyCapsule named "dltensor") calls the deleter when it is done; an export never
 * handed to one must be released with emsa_dlpack_delete, exactly once. */
typedef struct emsa_device_arena emsa_device_arena;

#define EMSA_DEVICE_ARENA_VMM 0         /* CUDA virtual memory */
#define EMSA_DEVICE_ARENA_CUDA_MALLOC 1 /* cudaMalloc; fallback_reason says why */

EMSA_API emsa_status emsa_device_arena_create(uint64_t bytes, int32_t device,
                                              emsa_device_arena** arena_out);
EMSA_API void emsa_device_arena_destroy(emsa_device_arena* arena);
/* Any output may be NULL. *fallback_reason_out ("" for VMM) is freed with emsa_free. */
EMSA_API emsa_status emsa_device_arena_info(const emsa_device_arena* arena, void** data_out,
                                            uint64_t* bytes_out, int32_t* kind_out,
                                            char** fallback_reason_out);
EMSA_API emsa_status emsa_device_arena_export(const emsa_device_arena* arena, uint64_t offset,
                                              const int64_t* shape, int32_t ndim, int32_t dtype,
                                              void** dlmanaged_out);
/* Runs an export's deleter (NULL: no-op). */
EMSA_API void emsa_dlpack_delete(void* dlmanaged);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EMSA_EMSA_DEVICE_H_ */
