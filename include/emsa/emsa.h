/* emsa.h — the C ABI of libemsa.
 *
 * This is what the Python front end calls through ctypes, and what any other language binds.
 * One built library serves every Python and every torch version: nothing here mentions torch.
 *
 * Conventions
 *  - Every fallible call returns emsa_status (EMSA_OK = 0). On failure, emsa_last_error()
 *    returns a message for the calling thread, valid until that thread's next emsa call.
 *    A failed call changes nothing and leaves output pointers untouched.
 *  - Opaque handles come in create/destroy pairs. destroy(NULL) is a no-op.
 *  - Strings returned through char** are owned by the caller: release them with emsa_free().
 *  - Structs passed in begin with `struct_size`, set by the caller with the matching
 *    emsa_*_init(), so fields can be appended later without breaking old callers.
 *  - Element counts are int64_t, byte sizes uint64_t. Pointers are raw host pointers.
 *  - No call throws; no call exits the process.
 *  - Thread safety: handles are not shared between threads without external locking;
 *    different handles may be used from different threads.
 */
#ifndef EMSA_EMSA_H_
#define EMSA_EMSA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define EMSA_API __declspec(dllexport)
#else
#define EMSA_API __attribute__((visibility("default")))
#endif

#define EMSA_ABI_VERSION 1

/* ---- status -------------------------------------------------------------------------------- */
typedef int32_t emsa_status;
#define EMSA_OK 0
#define EMSA_INVALID_ARGUMENT 1
#define EMSA_PARSE_ERROR 2
#define EMSA_UNSUPPORTED 3
#define EMSA_INFEASIBLE 4
#define EMSA_OUT_OF_MEMORY 5
#define EMSA_CUDA_ERROR 6
#define EMSA_IO_ERROR 7
#define EMSA_NOT_FOUND 8
#define EMSA_INTERNAL 9

/* ---- constants ----------------------------------------------------------------------------- */
#define EMSA_DTYPE_FLOAT32 0
#define EMSA_DTYPE_BFLOAT16 1
#define EMSA_DTYPE_FLOAT16 2

#define EMSA_OPTIMIZER_ADAMW 0
#define EMSA_OPTIMIZER_ADAM 1
#define EMSA_OPTIMIZER_LION 2

#define EMSA_SIMD_SCALAR 0
#define EMSA_SIMD_AVX2 1
#define EMSA_SIMD_AVX512 2

#define EMSA_ROUNDING_NEAREST 0
#define EMSA_ROUNDING_STOCHASTIC 1

/* ---- library ------------------------------------------------------------------------------- */
EMSA_API uint32_t emsa_abi_version(void);   /* EMSA_ABI_VERSION of the built library */
EMSA_API const char* emsa_version(void);    /* "0.1.0"; static, do not free */
EMSA_API const char* emsa_last_error(void); /* "" when the last call succeeded */
EMSA_API void emsa_free(void* p);           /* frees strings returned by emsa */
EMSA_API emsa_status emsa_parse_bytes(const char* text, uint64_t* bytes_out); /* "24GiB" */

/* ---- device profile ------------------------------------------------------------------------ */
/* The highest SIMD level this CPU supports (EMSA_SIMD_*), after the EMSA_MAX_SIMD cap. */
EMSA_API int32_t emsa_simd_level(void);
/* Measures this machine (CPU; GPU when one is usable) and returns the profile as JSON.
 * measure_bandwidth = 0 skips the timed parts. Takes well under a second on the CPU side. */
EMSA_API emsa_status emsa_profile_measure(int32_t measure_bandwidth, int32_t gpu_device,
                                          char** json_out);

/* The profile kept in the machine's cache (emsa/profile_cache.h): the untimed description read
 * now, the bandwidths from the cache file when it holds this machine's (same GPU, driver, CPU
 * model, cores, format) and is younger than max_age_seconds, else measured now and the file
 * rewritten atomically. folder NULL or "": $XDG_CACHE_HOME/emsa, else ~/.cache/emsa;
 * max_age_seconds < 0: the default (a week); refresh != 0 measures and rewrites regardless.
 * JSON out: {"profile": {...}, "path": "...", "from_cache": bool, "age_seconds": s,
 * "why_measured": "...", "why_not_saved": "...", "key": "...", "summary": "from cache PATH,
 * measured 3 h ago" or "measured now (why), cached at PATH"}. */
EMSA_API emsa_status emsa_profile_cached(int32_t gpu_device, const char* folder,
                                         int64_t max_age_seconds, int32_t refresh, char** json_out);
/* Bandwidth measurements emsa_profile_cached made in this process (a cache hit adds none). */
EMSA_API int64_t emsa_profile_measurement_count(void);

/* The host tier's load made on purpose (emsa::HostLoad): the CPU update of `threads` threads
 * (0: the host tier's count) over `update_params` fp32 parameters' state, and with copies != 0
 * and a CUDA device, copies of `copy_bytes` both ways between pinned memory and `gpu_device`,
 * until emsa_host_load_stop. Returns once both run. The probe times the model under it. */
typedef struct emsa_host_load emsa_host_load;
EMSA_API emsa_status emsa_host_load_start(int32_t threads, int64_t update_params,
                                          int32_t gpu_device, int32_t copies, uint64_t copy_bytes,
                                          emsa_host_load** load_out);
/* Stops it, reports the first error it met, frees it (NULL is a no-op). Rounds done, when the
 * pointers are not NULL: CPU update steps, and copies each way. */
EMSA_API emsa_status emsa_host_load_stop(emsa_host_load* load, int64_t* update_rounds_out,
                                         int64_t* copy_rounds_out);

/* ---- plan ---------------------------------------------------------------------------------- */
typedef struct emsa_plan emsa_plan;

typedef struct emsa_plan_options {
  uint32_t struct_size;         /* sizeof(emsa_plan_options) */
  int32_t optimizer;            /* EMSA_OPTIMIZER_*; default ADAMW */
  int32_t state_dtype;          /* EMSA_DTYPE_FLOAT32 or _BFLOAT16; default FLOAT32 */
  int32_t allow_host_tier;      /* default 1 */
  int32_t force_all_host;       /* default 0 */
  uint64_t budget_bytes;        /* 0: free device memory minus the margin (no GPU: unlimited) */
  uint64_t safety_margin_bytes; /* default 1 GiB */
  uint64_t bucket_bytes;        /* default 32 MiB of parameters per bucket */
  int32_t release_grads;        /* 1: gradients freed in backward (step in backward); default 0 */
  /* share of the host tier's fp32 parameters the GPU updates, moments streamed through it
   * (PlanOptions.device_update_share): -1 (default) balanced by the planner, or 0..1 */
  double device_update_share;
} emsa_plan_options;

EMSA_API void emsa_plan_options_init(emsa_plan_options* options);

/* Plans a probe record (JSON text) against a device profile (JSON text, or NULL to use the
 * record's embedded profile, or else to measure this machine). On EMSA_INFEASIBLE the message
 * names the smallest budget that works and *min_budget_out (if not NULL) receives it. */
EMSA_API emsa_status emsa_plan_create(const char* probe_json, const char* profile_json,
                                      const emsa_plan_options* options, emsa_plan** plan_out,
                                      uint64_t* min_budget_out);
EMSA_API void emsa_plan_destroy(emsa_plan* plan);
EMSA_API emsa_status emsa_plan_to_json(const emsa_plan* plan, char** json_out);
EMSA_API emsa_status emsa_plan_to_table(const emsa_plan* plan, char** table_out);
/* Sizes the arenas must have: device state bytes and host state bytes. */
EMSA_API emsa_status emsa_plan_arena_bytes(const emsa_plan* plan, uint64_t* device_bytes,
                                           uint64_t* host_bytes);

/* The same table without the per-parameter rows and module ranges: totals and prediction. */
EMSA_API emsa_status emsa_plan_to_summary(const emsa_plan* plan, char** table_out);
/* The lines a plan opens with (fits or not, step time and tokens/s, host memory, tier split),
 * against the profile it was made for (JSON text); tokens_per_step 0: no tokens/s. */
EMSA_API emsa_status emsa_plan_verdict(const emsa_plan* plan, const char* profile_json,
                                       int64_t tokens_per_step, char** verdict_out);

/* The `emsa` command (`emsa --help`): runs it with argv[0..argc) (no program name) and returns
 * what it prints, to stdout and stderr, in *out and *err (free both with emsa_free), and its exit
 * code in *exit_code (0 ok, 2 usage or bad input, 3 the plan does not fit, 1 other errors). */
EMSA_API emsa_status emsa_cli_run(int argc, const char* const* argv, int* exit_code, char** out,
                                  char** err);

/* ---- models: an analytic probe from a config (emsa/model_config.h) ------------------------- */
typedef struct emsa_model_options {
  uint32_t struct_size;             /* sizeof(emsa_model_options) */
  int32_t activation_checkpointing; /* 1: each layer keeps only its input; default 0 */
  int64_t batch;                    /* sequences per step; default 1 */
  int64_t seq_len;                  /* tokens per sequence; 0 (default): the model's context,
                                       at most 2048 */
  int32_t param_dtype;              /* EMSA_DTYPE_*: the parameters on the device; default
                                       BFLOAT16 (fp32 master in the optimizer state); training
                                       runs under bf16 autocast either way */
  double matmul_flops;              /* FLOP/s forward/backward reach; 0 (default): 400e12, or
                                       take "matmul_flops" from emsa_device_preset's JSON */
  int32_t eager_attention;          /* 1: attention saves its s x s scores for backward;
                                       default 0 (fused attention: SDPA, FlashAttention) */
} emsa_model_options;

EMSA_API void emsa_model_options_init(emsa_model_options* options);
/* A probe record (JSON, as emsa_plan_create reads it) computed from a model's shape: `model` is
 * a preset name ("llama-2-7b"), a Hugging Face config.json's text (starting with '{'), or a
 * path to one (or to its folder). *summary_out (if summary_out is not NULL) receives a few lines
 * for a person: family, parameter count, shape, training setup, times and device peak. Unknown
 * presets are EMSA_NOT_FOUND (the message lists them); a config missing a field or of an
 * unsupported model_type is EMSA_INVALID_ARGUMENT naming the field. */
EMSA_API emsa_status emsa_model_probe(const char* model, const emsa_model_options* options,
                                      char** probe_json_out, char** summary_out);
/* Why a budget cannot be met, for a person, as the `emsa` command prints it after "emsa: ":
 * plans as emsa_plan_create does, and where that is EMSA_INFEASIBLE, returns EMSA_OK with
 * *message_out naming the smallest budget that works (for a model, also what it needs with the
 * host tier switched and what would shrink the need); "" where the budget can be met. model: the
 * options emsa_model_probe made probe_json with, or NULL for a probe record from a training run.
 * Other failures are emsa_plan_create's. */
EMSA_API emsa_status emsa_plan_infeasible_message(const char* probe_json, const char* profile_json,
                                                  const emsa_plan_options* options,
                                                  const emsa_model_options* model,
                                                  char** message_out);
/* A built-in device profile ("h200", "a100-40gb", "rtx-4090") as JSON: a DeviceProfile
 * (emsa_plan_create's profile_json) with a "note" on where its numbers come from and the
 * "matmul_flops" to put in emsa_model_options. Unknown names: EMSA_NOT_FOUND listing them. */
EMSA_API emsa_status emsa_device_preset(const char* name, char** json_out);

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

/* ---- CPU optimizer step -------------------------------------------------------------------- */
typedef struct emsa_cpu_updater emsa_cpu_updater;

typedef struct emsa_hyperparams {
  uint32_t struct_size; /* sizeof(emsa_hyperparams); values are doubles, as torch's */
  double lr;            /* default 1e-3 */
  double beta1;         /* default 0.9 */
  double beta2;         /* default 0.999 */
  double eps;           /* default 1e-8 */
  double weight_decay;  /* default 1e-2 */
  int32_t maximize;     /* default 0 */
} emsa_hyperparams;

typedef struct emsa_tensor_update {
  uint32_t struct_size; /* sizeof(emsa_tensor_update) */
  int32_t param_dtype;  /* EMSA_DTYPE_* */
  int32_t grad_dtype;
  int32_t state_dtype;
  void* param; /* numel elements, updated in place */
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq; /* NULL for Lion */
  float* master;    /* fp32 master weights, or NULL */
  int64_t numel;
  int64_t step; /* this update's step number, >= 1 */
  const emsa_hyperparams* hyper;
} emsa_tensor_update;

typedef struct emsa_step_options {
  uint32_t struct_size;  /* sizeof(emsa_step_options) */
  int32_t optimizer;     /* EMSA_OPTIMIZER_*; default ADAMW */
  float grad_multiplier; /* clip_coef / loss_scale; default 1 */
  int32_t check_finite;  /* 1: any inf/nan gradient skips the whole step; default 0 */
  int32_t rounding;      /* EMSA_ROUNDING_*; default STOCHASTIC (only bf16/fp16 stores) */
  uint64_t seed;         /* stochastic rounding stream; default 0 */
} emsa_step_options;

typedef struct emsa_step_report {
  uint32_t struct_size; /* sizeof(emsa_step_report) */
  int32_t skipped;      /* 1: non-finite gradient found, nothing written */
  int64_t nonfinite_count;
  int64_t first_nonfinite_tensor;
} emsa_step_report;

EMSA_API void emsa_hyperparams_init(emsa_hyperparams* hyper);
EMSA_API void emsa_tensor_update_init(emsa_tensor_update* tensor);
EMSA_API void emsa_step_options_init(emsa_step_options* options);
EMSA_API void emsa_step_report_init(emsa_step_report* report);

/* threads <= 0: all cores this process may use. max_simd caps the ISA (EMSA_SIMD_*). */
EMSA_API emsa_status emsa_cpu_updater_create(int32_t threads, int32_t max_simd,
                                             emsa_cpu_updater** updater_out);
EMSA_API void emsa_cpu_updater_destroy(emsa_cpu_updater* updater);
EMSA_API emsa_status emsa_cpu_updater_info(const emsa_cpu_updater* updater, int32_t* threads_out,
                                           int32_t* simd_out);
/* One optimizer step over `count` tensors on the updater's worker pool; returns when done.
 * Validates everything first; an invalid batch changes nothing. Allocates nothing. */
EMSA_API emsa_status emsa_cpu_step(emsa_cpu_updater* updater, const emsa_tensor_update* tensors,
                                   size_t count, const emsa_step_options* options,
                                   emsa_step_report* report);
/* Sum of squares of all gradients and the count of non-finite elements, in one pass. */
EMSA_API emsa_status emsa_cpu_grad_stats(emsa_cpu_updater* updater,
                                         const emsa_tensor_update* tensors, size_t count,
                                         double* sum_sq_out, int64_t* nonfinite_out);

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
/* The same for a host arena; views are kDLCPU (pinned or not), which torch accepts. */
EMSA_API emsa_status emsa_host_arena_export(const emsa_host_arena* arena, uint64_t offset,
                                            const int64_t* shape, int32_t ndim, int32_t dtype,
                                            void** dlmanaged_out);
/* Runs an export's deleter (NULL: no-op). */
EMSA_API void emsa_dlpack_delete(void* dlmanaged);

/* ---- host tier for CUDA parameters (emsa/host_tier.h) -------------------------------------- *
 * Gradients down on d2h_stream as each bucket becomes ready, the CPU update on the updater's
 * pool from a worker thread, parameters up on h2d_stream; the compute stream waits only per
 * bucket (emsa_host_tier_wait), never for the whole step. The updater and both streams must
 * outlive the tier, and nothing else may call the updater while the tier exists. */
typedef struct emsa_host_tier emsa_host_tier;

typedef struct emsa_host_tier_tensor {
  uint32_t struct_size; /* sizeof(emsa_host_tier_tensor) */
  /* Host pointers: param is what the CPU update writes (the fp32 master of an fp32 parameter,
   * master NULL; else a bf16/fp16 staging buffer with master the fp32 master); grad the staging
   * buffer the gradient is copied into. .step and .hyper are ignored (set per step). */
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

#endif /* EMSA_EMSA_H_ */
