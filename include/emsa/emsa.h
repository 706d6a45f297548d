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
 *
 * Parts: this file (conventions, status, constants, the library, the device profile, plans,
 * model probes, the CPU optimizer step) includes the rest at its end, emsa_device.h (the
 * device tier's fused CUDA updates, the device arena and DLPack views) and emsa_host.h (the
 * pinned host arena, the host tier for CUDA parameters). Include this file: it is the whole
 * ABI; the parts refuse to be included alone.
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
  /* 1: every step's updates wait for all of its gradients (max_grad_norm, the non-finite check,
   * a loss scale: PlanOptions.gated_steps); default 0 */
  int32_t gated_steps;
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
  void* param;      /* numel elements, updated in place */
  const void* grad; /* may be param itself in the same dtype (read before written) */
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

/* A gated step: one that needs every gradient's statistics before any update (clipping by the
 * global norm, the non-finite check, a loss scale). The verdict is the one the CUDA step header
 * gives (src/kernels/step_verdict.h): any non-finite gradient element, sum or loss scale skips
 * the whole step; else norm = sqrt(sum_sq) / loss_scale, clip_coef = min(1, max_norm /
 * (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_), and every gradient is multiplied by
 * clip_coef / loss_scale inside the update. */
typedef struct emsa_step_gate {
  uint32_t struct_size;    /* sizeof(emsa_step_gate) */
  float max_norm;          /* clip threshold; 0: no clipping (default) */
  float loss_scale;        /* the gradients' scale (a GradScaler's): divided out; default 1 */
  int32_t stats_given;     /* 1: sum_sq and nonfinite_count below are the step's (summed over
                            * the ranks that each hold part of the gradients); 0 (default): the
                            * updater scans this batch's gradients */
  double sum_sq;           /* with stats_given: the sum of squares of every gradient */
  int64_t nonfinite_count; /* with stats_given: their non-finite elements */
} emsa_step_gate;

typedef struct emsa_step_verdict {
  uint32_t struct_size;           /* sizeof(emsa_step_verdict) */
  int32_t skipped;                /* 1: nothing was written */
  int64_t nonfinite_count;        /* non-finite gradient elements (of the whole step) */
  int64_t first_nonfinite_tensor; /* index in this batch of the first, when skipped; else -1 */
  double sum_sq;                  /* of the (scaled) gradients */
  double grad_norm;               /* unscaled, rounded to float; as torch's clip_grad_norm_ */
  float clip_coef;                /* 1 when not clipped */
  float grad_multiplier;          /* what every gradient element was multiplied by */
} emsa_step_verdict;

EMSA_API void emsa_step_gate_init(emsa_step_gate* gate);
EMSA_API void emsa_step_verdict_init(emsa_step_verdict* verdict);
/* emsa_cpu_step of a gated step: the statistics (unless given), the verdict, then the update
 * with the verdict's multiplier (options->grad_multiplier and check_finite are not read), or
 * nothing when skipped. One call; allocates nothing. */
EMSA_API emsa_status emsa_cpu_step_gated(emsa_cpu_updater* updater,
                                         const emsa_tensor_update* tensors, size_t count,
                                         const emsa_step_options* options,
                                         const emsa_step_gate* gate, emsa_step_verdict* verdict);

#ifdef __cplusplus
} /* extern "C" */
#endif

#include "emsa/emsa_device.h"
#include "emsa/emsa_host.h"

#endif /* EMSA_EMSA_H_ */
