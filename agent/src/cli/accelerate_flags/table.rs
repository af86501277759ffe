//! The table of `accelerate launch`'s flags that muster has no spelling for ([`FLAGS`]): each
//! row names the flag (both spellings, as Accelerate's parser takes them), how argparse reads
//! its value, its default, the variable it becomes and when; and how a row becomes a clap
//! argument. [`super::AccelerateFlags`] reads the flags given through it.

use crate::accelerate_config::PyValue;
use clap::{Arg, ArgAction};

/// The `--help` heading of the flags that reach the workers (or the agent, `-q`).
pub(super) const PASSED: &str =
    "Accelerate compatibility: passed to the workers as under accelerate launch";
/// The `--help` heading of the flags accepted without effect.
pub(super) const NO_EFFECT: &str = "Accelerate compatibility: accepted, no effect under muster";

/// How argparse reads a flag's value (`type=` and `action=` in Accelerate's parser).
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    /// `store_true`.
    Switch,
    /// `type=str`.
    Text,
    /// `type=int`.
    Int,
    /// `type=float`.
    Float,
    /// `type=str` with `choices` (case-sensitive, as argparse checks them).
    Choice(&'static [&'static str]),
    /// `--dynamo_backend`: one of [`DYNAMO_BACKENDS`], in any case.
    DynamoBackend,
    /// `type=bool`: Python's `bool(str)`, so any non-empty value (even `False`) is true.
    PyBool,
    /// Accelerate's `str_to_bool`: 1 or 0.
    StrToBool,
    /// `--fp8_override_linear_precision`: three `str_to_bool`s, comma-separated.
    BoolTriple,
    /// `action="append"`: repeatable.
    Append,
}

/// A flag's default in Accelerate's parser.
#[derive(Debug, Clone, Copy)]
pub(super) enum Def {
    /// `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`, kept as it is.
    Str(&'static str),
    /// A `str` that argparse runs through the flag's `type` (`str_to_bool("true")` is 1).
    Parsed(&'static str),
}

/// What a flag is for, and when Accelerate's launcher passes it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Group {
    /// `-q`: the agent's own informational lines.
    Quiet,
    /// `--env KEY=VALUE`: the workers' environment.
    Env,
    /// OMP_NUM_THREADS.
    Threads,
    /// `--use_fsdp`, `--use_deepspeed`, ...: which of Accelerate's launchers runs.
    Paradigm,
    /// ACCELERATE_DYNAMO_* (not with DeepSpeed).
    Dynamo,
    /// ACCELERATE_DEEPSPEED_* and friends (with `--use_deepspeed`).
    DeepSpeed,
    /// FSDP_* (with `--use_fsdp`).
    Fsdp,
    /// MEGATRON_LM_* (with `--use_megatron_lm`).
    Megatron,
    /// ACCELERATE_FP8_* (with `--mixed_precision fp8`).
    Fp8,
    /// PARALLELISM_CONFIG_* (with `--use_parallelism_config`).
    Parallelism,
    /// No effect under muster, for the reason given.
    NoEffect(&'static str),
}

/// When a flag's variable is set (Accelerate's launcher sets some always, with the default,
/// and some only when not `None`), and whether its value is lower-cased (`str(x).lower()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Emit {
    /// Not by the table (handled by the group's own code, or no variable).
    Never,
    /// `str(value)`, always.
    Always,
    /// `str(value).lower()`, always.
    AlwaysLower,
    /// `str(value)` unless `None`.
    IfSet,
    /// `str(value).lower()` unless `None`.
    IfSetLower,
    /// `str(value)`, always, when the named setting is above 1 (parallelism's sizes).
    WhenAboveOne(&'static str),
}

/// One `accelerate launch` flag.
#[derive(Debug)]
pub(super) struct Flag {
    /// Accelerate's name, which is also its `--snake_case` spelling and its key in a config
    /// file's section (after Accelerate's prefixing).
    pub(super) name: &'static str,
    /// The `--dash-case` spelling; `""` for a config-file key with no flag.
    pub(super) dash: &'static str,
    /// `-q` for `--quiet`.
    pub(super) short: Option<char>,
    pub(super) kind: Kind,
    pub(super) default: Def,
    pub(super) group: Group,
    /// The variable it becomes (with `emit`).
    pub(super) var: &'static str,
    pub(super) emit: Emit,
    /// The `--help` line.
    pub(super) help: &'static str,
}

/// TorchDynamo backends Accelerate knows (`accelerate.utils.DynamoBackend`).
pub(super) const DYNAMO_BACKENDS: [&str; 16] = [
    "NO",
    "EAGER",
    "AOT_EAGER",
    "INDUCTOR",
    "AOT_TS_NVFUSER",
    "NVPRIMS_NVFUSER",
    "CUDAGRAPHS",
    "OFI",
    "FX2TRT",
    "ONNXRT",
    "TENSORRT",
    "AOT_TORCHXLA_TRACE_ONCE",
    "TORCHXLA_TRACE_ONCE",
    "TVM",
    "HPU_BACKEND",
    "NEURON",
];

pub(super) const TPU: &str =
    "muster runs PyTorch processes on the machines its agents run on, not on TPUs";
pub(super) const DS_LAUNCHER: &str = "DeepSpeed's multi-node launcher (pdsh, ssh) is not used: run `muster-agent launch` on every node, as with Accelerate's `standard` launcher";
pub(super) const SAGEMAKER: &str = "muster does not launch on Amazon SageMaker";
pub(super) const NVME: &str = "Accelerate's launcher passes it to no worker either";

/// Shorthand for a row of [`FLAGS`].
#[allow(clippy::too_many_arguments)]
pub(super) const fn flag(
    name: &'static str,
    dash: &'static str,
    kind: Kind,
    default: Def,
    group: Group,
    var: &'static str,
    emit: Emit,
    help: &'static str,
) -> Flag {
    Flag {
        name,
        dash,
        short: None,
        kind,
        default,
        group,
        var,
        emit,
        help,
    }
}

use Def as D;
use Emit as E;
use Group as G;
use Kind as K;

/// Every `accelerate launch` flag (accelerate 1.15) that `LaunchArgs` has no field for, in
/// Accelerate's order, and the config-file keys that have no flag (`dash` empty).
#[rustfmt::skip]
pub(super) const FLAGS: &[Flag] = &[
    Flag { short: Some('q'), ..flag("quiet", "", K::Switch, D::None, G::Quiet, "", E::Never,
        "Leave out the agent's informational lines and notes (warnings and errors stay)") },
    flag("num_cpu_threads_per_process", "num-cpu-threads-per-process", K::Int, D::None, G::Threads, muster_core::contract::env::OMP_NUM_THREADS, E::Never,
        "OMP_NUM_THREADS for every worker (beats the agent's own)"),
    flag("dynamo_backend", "dynamo-backend", K::DynamoBackend, D::None, G::Dynamo, "ACCELERATE_DYNAMO_BACKEND", E::Never,
        "TorchDynamo backend (ACCELERATE_DYNAMO_BACKEND, upper case): no, eager, inductor, ..."),
    flag("dynamo_mode", "dynamo-mode", K::Choice(&["default", "reduce-overhead", "max-autotune"]), D::Str("default"), G::Dynamo, "ACCELERATE_DYNAMO_MODE", E::Always,
        "ACCELERATE_DYNAMO_MODE"),
    flag("dynamo_use_fullgraph", "dynamo-use-fullgraph", K::Switch, D::Bool(false), G::Dynamo, "ACCELERATE_DYNAMO_USE_FULLGRAPH", E::Always,
        "ACCELERATE_DYNAMO_USE_FULLGRAPH=True"),
    flag("dynamo_use_dynamic", "dynamo-use-dynamic", K::Switch, D::Bool(false), G::Dynamo, "ACCELERATE_DYNAMO_USE_DYNAMIC", E::Always,
        "ACCELERATE_DYNAMO_USE_DYNAMIC=True"),
    flag("dynamo_use_regional_compilation", "dynamo-use-regional-compilation", K::Switch, D::Bool(false), G::Dynamo, "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", E::Always,
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=True"),
    flag("use_deepspeed", "use-deepspeed", K::Switch, D::Bool(false), G::Paradigm, "", E::Never,
        "DeepSpeed (ACCELERATE_USE_DEEPSPEED and the --zero_stage, --offload_* ... settings)"),
    flag("use_fsdp", "use-fsdp", K::Switch, D::Bool(false), G::Paradigm, "", E::Never,
        "FSDP (ACCELERATE_USE_FSDP and the --fsdp_* settings)"),
    flag("use_parallelism_config", "use-parallelism-config", K::Switch, D::Bool(false), G::Paradigm, "", E::Never,
        "Accelerate's ParallelismConfig (PARALLELISM_CONFIG_*; needs --use_fsdp)"),
    flag("use_megatron_lm", "use-megatron-lm", K::Switch, D::Bool(false), G::Paradigm, "", E::Never,
        "Megatron-LM (ACCELERATE_USE_MEGATRON_LM and the --megatron_lm_* settings)"),
    flag("same_network", "same-network", K::Switch, D::Bool(false), G::NoEffect("muster's rendezvous goes through its coordinator whether or not the machines share a network"), "", E::Never,
        "Machines on one network (Accelerate: static MASTER_ADDR instead of a rendezvous endpoint)"),
    flag("tpu", "", K::Switch, D::Bool(false), G::NoEffect(TPU), "", E::Never, "TPU training"),
    flag("tpu_cluster", "tpu-cluster", K::Switch, D::Bool(false), G::NoEffect(TPU), "", E::Never, "A TPU pod"),
    flag("no_tpu_cluster", "no-tpu-cluster", K::Switch, D::None, G::NoEffect(TPU), "", E::Never, "Not a TPU pod"),
    flag("tpu_use_sudo", "tpu-use-sudo", K::Switch, D::Bool(false), G::NoEffect(TPU), "", E::Never, "sudo on the TPU pod's VMs"),
    flag("vm", "", K::Append, D::None, G::NoEffect(TPU), "", E::Never, "A TPU pod VM (repeatable)"),
    flag("env", "", K::Append, D::None, G::Env, "", E::Never,
        "KEY=VALUE added to every worker's environment (repeatable; Accelerate sets it on TPU pod VMs)"),
    flag("main_training_function", "main-training-function", K::Text, D::None, G::NoEffect("only Accelerate's TPU launcher calls a function by name; muster runs the script"), "", E::Never,
        "The function Accelerate's TPU launcher calls"),
    flag("downcast_bf16", "downcast-bf16", K::Switch, D::Bool(false), G::NoEffect("it applies on TPUs only (XLA_DOWNCAST_BF16)"), "", E::Never,
        "bf16 as XLA's downcast on TPUs"),
    flag("deepspeed_config_file", "deepspeed-config-file", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_CONFIG_FILE", E::IfSet,
        "ACCELERATE_DEEPSPEED_CONFIG_FILE"),
    flag("zero_stage", "zero-stage", K::Int, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_ZERO_STAGE", E::IfSet,
        "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    flag("offload_optimizer_device", "offload-optimizer-device", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", E::IfSetLower,
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
    flag("offload_param_device", "offload-param-device", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", E::IfSetLower,
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    flag("offload_optimizer_nvme_path", "offload-optimizer-nvme-path", K::Text, D::None, G::NoEffect(NVME), "", E::Never,
        "DeepSpeed's optimizer NVMe offload path"),
    flag("offload_param_nvme_path", "offload-param-nvme-path", K::Text, D::None, G::NoEffect(NVME), "", E::Never,
        "DeepSpeed's parameter NVMe offload path"),
    flag("gradient_accumulation_steps", "gradient-accumulation-steps", K::Int, D::None, G::DeepSpeed, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", E::IfSet,
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS (with --use_deepspeed, as under accelerate launch)"),
    flag("gradient_clipping", "gradient-clipping", K::Float, D::None, G::DeepSpeed, "ACCELERATE_GRADIENT_CLIPPING", E::IfSetLower,
        "ACCELERATE_GRADIENT_CLIPPING (with --use_deepspeed)"),
    flag("zero3_init_flag", "zero3-init-flag", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_ZERO3_INIT", E::IfSetLower,
        "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
    flag("zero3_save_16bit_model", "zero3-save-16bit-model", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", E::IfSetLower,
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
    flag("deepspeed_hostfile", "deepspeed-hostfile", K::Text, D::None, G::NoEffect(DS_LAUNCHER), "", E::Never,
        "DeepSpeed's hostfile"),
    flag("deepspeed_exclusion_filter", "deepspeed-exclusion-filter", K::Text, D::None, G::NoEffect(DS_LAUNCHER), "", E::Never,
        "DeepSpeed's --exclude"),
    flag("deepspeed_inclusion_filter", "deepspeed-inclusion-filter", K::Text, D::None, G::NoEffect(DS_LAUNCHER), "", E::Never,
        "DeepSpeed's --include"),
    flag("deepspeed_multinode_launcher", "deepspeed-multinode-launcher", K::Text, D::None, G::NoEffect(DS_LAUNCHER), "", E::Never,
        "DeepSpeed's multi-node launcher"),
    flag("deepspeed_moe_layer_cls_names", "deepspeed-moe-layer-cls-names", K::Text, D::None, G::DeepSpeed, "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", E::IfSet,
        "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"),
    flag("fsdp_version", "fsdp-version", K::Choice(&["1", "2"]), D::Str("1"), G::Fsdp, "FSDP_VERSION", E::Always,
        "FSDP_VERSION"),
    flag("fsdp_sharding_strategy", "fsdp-sharding-strategy", K::Text, D::Str("FULL_SHARD"), G::Fsdp, "FSDP_SHARDING_STRATEGY", E::Always,
        "FSDP_SHARDING_STRATEGY"),
    flag("fsdp_reshard_after_forward", "fsdp-reshard-after-forward", K::Text, D::Str("true"), G::Fsdp, "FSDP_RESHARD_AFTER_FORWARD", E::AlwaysLower,
        "FSDP_RESHARD_AFTER_FORWARD"),
    flag("fsdp_offload_params", "fsdp-offload-params", K::Text, D::Str("false"), G::Fsdp, "FSDP_OFFLOAD_PARAMS", E::AlwaysLower,
        "FSDP_OFFLOAD_PARAMS"),
    flag("fsdp_min_num_params", "fsdp-min-num-params", K::Int, D::Int(100_000_000), G::Fsdp, "FSDP_MIN_NUM_PARAMS", E::Always,
        "FSDP_MIN_NUM_PARAMS"),
    flag("fsdp_auto_wrap_policy", "fsdp-auto-wrap-policy", K::Text, D::None, G::Fsdp, "FSDP_AUTO_WRAP_POLICY", E::IfSet,
        "FSDP_AUTO_WRAP_POLICY"),
    flag("fsdp_transformer_layer_cls_to_wrap", "fsdp-transformer-layer-cls-to-wrap", K::Text, D::None, G::Fsdp, "FSDP_TRANSFORMER_CLS_TO_WRAP", E::IfSet,
        "FSDP_TRANSFORMER_CLS_TO_WRAP"),
    flag("fsdp_backward_prefetch", "fsdp-backward-prefetch", K::Text, D::None, G::Fsdp, "FSDP_BACKWARD_PREFETCH", E::IfSet,
        "FSDP_BACKWARD_PREFETCH"),
    flag("fsdp_state_dict_type", "fsdp-state-dict-type", K::Text, D::None, G::Fsdp, "FSDP_STATE_DICT_TYPE", E::IfSet,
        "FSDP_STATE_DICT_TYPE"),
    flag("fsdp_forward_prefetch", "fsdp-forward-prefetch", K::Text, D::Str("false"), G::Fsdp, "FSDP_FORWARD_PREFETCH", E::AlwaysLower,
        "FSDP_FORWARD_PREFETCH"),
    flag("fsdp_use_orig_params", "fsdp-use-orig-params", K::Text, D::Str("true"), G::Fsdp, "FSDP_USE_ORIG_PARAMS", E::AlwaysLower,
        "FSDP_USE_ORIG_PARAMS"),
    flag("fsdp_cpu_ram_efficient_loading", "fsdp-cpu-ram-efficient-loading", K::Text, D::Str("true"), G::Fsdp, "FSDP_CPU_RAM_EFFICIENT_LOADING", E::AlwaysLower,
        "FSDP_CPU_RAM_EFFICIENT_LOADING (needs --fsdp_sync_module_states)"),
    flag("fsdp_sync_module_states", "fsdp-sync-module-states", K::Text, D::Str("true"), G::Fsdp, "FSDP_SYNC_MODULE_STATES", E::AlwaysLower,
        "FSDP_SYNC_MODULE_STATES"),
    flag("fsdp_activation_checkpointing", "fsdp-activation-checkpointing", K::Text, D::Str("false"), G::Fsdp, "FSDP_ACTIVATION_CHECKPOINTING", E::AlwaysLower,
        "FSDP_ACTIVATION_CHECKPOINTING"),
    flag("fsdp_activation_checkpointing_offload", "fsdp-activation-checkpointing-offload", K::Text, D::Str("false"), G::Fsdp, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", E::AlwaysLower,
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"),
    // fsdp_config only: no flag.
    flag("fsdp_ignored_modules", "", K::Text, D::None, G::Fsdp, "FSDP_IGNORED_MODULES", E::IfSet, ""),
    flag("megatron_lm_tp_degree", "megatron-lm-tp-degree", K::Int, D::Int(1), G::Megatron, "MEGATRON_LM_TP_DEGREE", E::Always,
        "MEGATRON_LM_TP_DEGREE"),
    flag("megatron_lm_use_custom_fsdp", "megatron-lm-use-custom-fsdp", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_USE_CUSTOM_FSDP", E::Always,
        "MEGATRON_LM_USE_CUSTOM_FSDP (Python's bool(): any non-empty value is True)"),
    flag("megatron_lm_no_load_optim", "megatron-lm-no-load-optim", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_NO_LOAD_OPTIM", E::IfSet,
        "MEGATRON_LM_NO_LOAD_OPTIM"),
    flag("megatron_lm_eod_mask_loss", "megatron-lm-eod-mask-loss", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_EOD_MASK_LOSS", E::IfSet,
        "MEGATRON_LM_EOD_MASK_LOSS"),
    flag("megatron_lm_overlap_cpu_optimizer_d2h_h2d", "megatron-lm-overlap-cpu-optimizer-d2h-h2d", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_OVERLAP_CPU_OPTIMIZER_D2H_H2D", E::IfSet,
        "MEGATRON_LM_OVERLAP_CPU_OPTIMIZER_D2H_H2D"),
    flag("megatron_lm_no_save_optim", "megatron-lm-no-save-optim", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_NO_SAVE_OPTIM", E::IfSet,
        "MEGATRON_LM_NO_SAVE_OPTIM"),
    flag("megatron_lm_optimizer_cpu_offload", "megatron-lm-optimizer-cpu-offload", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_OPTIMIZER_CPU_OFFLOAD", E::IfSet,
        "MEGATRON_LM_OPTIMIZER_CPU_OFFLOAD"),
    flag("megatron_lm_use_precision_aware_optimizer", "megatron-lm-use-precision-aware-optimizer", K::PyBool, D::Bool(false), G::Megatron, "MEGATRON_LM_USE_PRECISION_AWARE_OPTIMIZER", E::IfSet,
        "MEGATRON_LM_USE_PRECISION_AWARE_OPTIMIZER"),
    flag("megatron_lm_decoder_last_pipeline_num_layers", "megatron-lm-decoder-last-pipeline-num-layers", K::Int, D::None, G::Megatron, "MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS", E::IfSet,
        "MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS"),
    flag("megatron_lm_pp_degree", "megatron-lm-pp-degree", K::Int, D::Int(1), G::Megatron, "MEGATRON_LM_PP_DEGREE", E::Always,
        "MEGATRON_LM_PP_DEGREE"),
    flag("megatron_lm_num_micro_batches", "megatron-lm-num-micro-batches", K::Int, D::None, G::Megatron, "MEGATRON_LM_NUM_MICRO_BATCHES", E::IfSet,
        "MEGATRON_LM_NUM_MICRO_BATCHES"),
    flag("megatron_lm_sequence_parallelism", "megatron-lm-sequence-parallelism", K::Text, D::None, G::Megatron, "MEGATRON_LM_SEQUENCE_PARALLELISM", E::IfSet,
        "MEGATRON_LM_SEQUENCE_PARALLELISM"),
    flag("megatron_lm_recompute_activations", "megatron-lm-recompute-activations", K::Text, D::None, G::Megatron, "MEGATRON_LM_RECOMPUTE_ACTIVATIONS", E::IfSet,
        "MEGATRON_LM_RECOMPUTE_ACTIVATIONS"),
    flag("megatron_lm_use_distributed_optimizer", "megatron-lm-use-distributed-optimizer", K::Text, D::None, G::Megatron, "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER", E::IfSet,
        "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER"),
    flag("megatron_lm_gradient_clipping", "megatron-lm-gradient-clipping", K::Float, D::Float(1.0), G::Megatron, "MEGATRON_LM_GRADIENT_CLIPPING", E::Always,
        "MEGATRON_LM_GRADIENT_CLIPPING"),
    flag("megatron_lm_recompute_granularity", "megatron-lm-recompute-granularity", K::Text, D::None, G::Megatron, "MEGATRON_LM_RECOMPUTE_GRANULARITY", E::IfSet,
        "MEGATRON_LM_RECOMPUTE_GRANULARITY"),
    flag("megatron_lm_recompute_method", "megatron-lm-recompute-method", K::Text, D::None, G::Megatron, "MEGATRON_LM_RECOMPUTE_METHOD", E::IfSet,
        "MEGATRON_LM_RECOMPUTE_METHOD"),
    flag("megatron_lm_recompute_num_layers", "megatron-lm-recompute-num-layers", K::Int, D::None, G::Megatron, "MEGATRON_LM_RECOMPUTE_NUM_LAYERS", E::IfSet,
        "MEGATRON_LM_RECOMPUTE_NUM_LAYERS"),
    flag("megatron_lm_attention_backend", "megatron-lm-attention-backend", K::Text, D::None, G::Megatron, "MEGATRON_LM_ATTENTION_BACKEND", E::IfSet,
        "MEGATRON_LM_ATTENTION_BACKEND"),
    flag("megatron_lm_expert_model_parallel_size", "megatron-lm-expert-model-parallel-size", K::Int, D::None, G::Megatron, "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE", E::IfSet,
        "MEGATRON_LM_EXPERT_MODEL_PARALLEL_SIZE"),
    flag("megatron_lm_context_parallel_size", "megatron-lm-context-parallel-size", K::Int, D::None, G::Megatron, "MEGATRON_LM_CONTEXT_PARALLEL_SIZE", E::IfSet,
        "MEGATRON_LM_CONTEXT_PARALLEL_SIZE"),
    flag("megatron_lm_attention_dropout", "megatron-lm-attention-dropout", K::Float, D::None, G::Megatron, "MEGATRON_LM_ATTENTION_DROPOUT", E::IfSet,
        "MEGATRON_LM_ATTENTION_DROPOUT"),
    flag("megatron_lm_hidden_dropout", "megatron-lm-hidden-dropout", K::Float, D::None, G::Megatron, "MEGATRON_LM_HIDDEN_DROPOUT", E::IfSet,
        "MEGATRON_LM_HIDDEN_DROPOUT"),
    flag("megatron_lm_attention_softmax_in_fp32", "megatron-lm-attention-softmax-in-fp32", K::Text, D::None, G::Megatron, "MEGATRON_LM_ATTENTION_SOFTMAX_IN_FP32", E::IfSet,
        "MEGATRON_LM_ATTENTION_SOFTMAX_IN_FP32"),
    flag("megatron_lm_expert_tensor_parallel_size", "megatron-lm-expert-tensor-parallel-size", K::Int, D::None, G::Megatron, "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE", E::IfSet,
        "MEGATRON_LM_EXPERT_TENSOR_PARALLEL_SIZE"),
    flag("megatron_lm_calculate_per_token_loss", "megatron-lm-calculate-per-token-loss", K::Text, D::None, G::Megatron, "MEGATRON_LM_CALCULATE_PER_TOKEN_LOSS", E::IfSet,
        "MEGATRON_LM_CALCULATE_PER_TOKEN_LOSS"),
    flag("megatron_lm_use_rotary_position_embeddings", "megatron-lm-use-rotary-position-embeddings", K::Text, D::None, G::Megatron, "MEGATRON_LM_USE_ROTARY_POSITION_EMBEDDINGS", E::IfSet,
        "MEGATRON_LM_USE_ROTARY_POSITION_EMBEDDINGS"),
    flag("fp8_backend", "fp8-backend", K::Choice(&["ao", "te", "msamp"]), D::None, G::Fp8, "ACCELERATE_FP8_BACKEND", E::IfSet,
        "ACCELERATE_FP8_BACKEND (with --mixed_precision fp8, as every --fp8_* flag)"),
    flag("fp8_use_autocast_during_eval", "fp8-use-autocast-during-eval", K::Switch, D::Bool(false), G::Fp8, "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", E::IfSet,
        "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL=True"),
    flag("fp8_margin", "fp8-margin", K::Int, D::Int(0), G::Fp8, "ACCELERATE_FP8_MARGIN", E::IfSet,
        "ACCELERATE_FP8_MARGIN"),
    flag("fp8_interval", "fp8-interval", K::Int, D::Int(1), G::Fp8, "ACCELERATE_FP8_INTERVAL", E::IfSet,
        "ACCELERATE_FP8_INTERVAL"),
    flag("fp8_format", "fp8-format", K::Choice(&["HYBRID", "E4M3", "E5M2"]), D::Str("HYBRID"), G::Fp8, "ACCELERATE_FP8_FORMAT", E::IfSet,
        "ACCELERATE_FP8_FORMAT"),
    flag("fp8_amax_history_len", "fp8-amax-history-len", K::Int, D::Int(1024), G::Fp8, "ACCELERATE_FP8_AMAX_HISTORY_LEN", E::IfSet,
        "ACCELERATE_FP8_AMAX_HISTORY_LEN"),
    flag("fp8_amax_compute_algo", "fp8-amax-compute-algo", K::Choice(&["max", "most_recent"]), D::Str("most_recent"), G::Fp8, "ACCELERATE_FP8_AMAX_COMPUTE_ALGO", E::IfSet,
        "ACCELERATE_FP8_AMAX_COMPUTE_ALGO"),
    flag("fp8_override_linear_precision", "fp8-override-linear-precision", K::BoolTriple, D::None, G::Fp8, "", E::Never,
        "ACCELERATE_FP8_OVERRIDE_FPROP, _DGRAD and _WGRAD, from three comma-separated booleans"),
    flag("fp8_opt_level", "fp8-opt-level", K::Choice(&["O1", "O2"]), D::Str("O2"), G::Fp8, "ACCELERATE_FP8_OPT_LEVEL", E::IfSet,
        "ACCELERATE_FP8_OPT_LEVEL"),
    flag("fp8_enable_fsdp_float8_all_gather", "fp8-enable-fsdp-float8-all-gather", K::StrToBool, D::Parsed("true"), G::Fp8, "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", E::IfSet,
        "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"),
    flag("fp8_pad_inner_dim", "fp8-pad-inner-dim", K::StrToBool, D::Parsed("true"), G::Fp8, "ACCELERATE_FP8_PAD_INNER_DIM", E::IfSet,
        "ACCELERATE_FP8_PAD_INNER_DIM"),
    flag("aws_access_key_id", "aws-access-key-id", K::Text, D::None, G::NoEffect(SAGEMAKER), "", E::Never,
        "SageMaker's AWS access key"),
    flag("aws_secret_access_key", "aws-secret-access-key", K::Text, D::None, G::NoEffect(SAGEMAKER), "", E::Never,
        "SageMaker's AWS secret key"),
    flag("mpirun_hostfile", "mpirun-hostfile", K::Text, D::None, G::NoEffect("muster starts each node's processes itself: run the agent on every host (or under srun)"), "", E::Never,
        "mpirun's hostfile (Accelerate's multi-CPU launcher)"),
    flag("parallelism_config_dp_replicate_size", "parallelism-config-dp-replicate-size", K::Int, D::Int(1), G::Parallelism, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", E::Always,
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
    flag("parallelism_config_dp_shard_size", "parallelism-config-dp-shard-size", K::Int, D::Int(1), G::Parallelism, "PARALLELISM_CONFIG_DP_SHARD_SIZE", E::Always,
        "PARALLELISM_CONFIG_DP_SHARD_SIZE"),
    flag("parallelism_config_tp_size", "parallelism-config-tp-size", K::Int, D::Int(1), G::Parallelism, "PARALLELISM_CONFIG_TP_SIZE", E::Always,
        "PARALLELISM_CONFIG_TP_SIZE"),
    flag("parallelism_config_cp_size", "parallelism-config-cp-size", K::Int, D::Int(1), G::Parallelism, "PARALLELISM_CONFIG_CP_SIZE", E::Always,
        "PARALLELISM_CONFIG_CP_SIZE"),
    flag("parallelism_config_cp_backend", "parallelism-config-cp-backend", K::Choice(&["torch"]), D::Str("torch"), G::Parallelism, "PARALLELISM_CONFIG_CP_BACKEND", E::Always,
        "PARALLELISM_CONFIG_CP_BACKEND"),
    flag("parallelism_config_cp_comm_strategy", "parallelism-config-cp-comm-strategy", K::Text, D::Str("allgather"), G::Parallelism, "PARALLELISM_CONFIG_CP_COMM_STRATEGY", E::WhenAboveOne("parallelism_config_cp_size"),
        "PARALLELISM_CONFIG_CP_COMM_STRATEGY (with a cp size above 1)"),
    flag("parallelism_config_sp_size", "parallelism-config-sp-size", K::Int, D::Int(1), G::Parallelism, "PARALLELISM_CONFIG_SP_SIZE", E::Always,
        "PARALLELISM_CONFIG_SP_SIZE"),
    flag("parallelism_config_sp_backend", "parallelism-config-sp-backend", K::Choice(&["deepspeed"]), D::Str("deepspeed"), G::Parallelism, "PARALLELISM_CONFIG_SP_BACKEND", E::Always,
        "PARALLELISM_CONFIG_SP_BACKEND"),
    flag("parallelism_config_sp_seq_length", "parallelism-config-sp-seq-length", K::Text, D::None, G::Parallelism, "PARALLELISM_CONFIG_SP_SEQ_LENGTH", E::WhenAboveOne("parallelism_config_sp_size"),
        "PARALLELISM_CONFIG_SP_SEQ_LENGTH (with an sp size above 1)"),
    flag("parallelism_config_sp_seq_length_is_variable", "parallelism-config-sp-seq-length-is-variable", K::PyBool, D::Bool(true), G::Parallelism, "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", E::WhenAboveOne("parallelism_config_sp_size"),
        "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE (with an sp size above 1)"),
    flag("parallelism_config_sp_attn_implementation", "parallelism-config-sp-attn-implementation", K::Text, D::Str("sdpa"), G::Parallelism, "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", E::WhenAboveOne("parallelism_config_sp_size"),
        "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION (with an sp size above 1)"),
];

impl Kind {
    /// Reads a value as argparse would.
    pub(super) fn parse(self, s: &str) -> Result<PyValue, String> {
        let number = || format!("expected a whole number, found '{s}'");
        Ok(match self {
            Self::Switch | Self::Append | Self::Text => PyValue::Str(s.to_owned()),
            Self::Int => PyValue::Int(s.trim().parse().map_err(|_| number())?),
            Self::Float => PyValue::Float(
                s.trim()
                    .parse()
                    .map_err(|_| format!("expected a number, found '{s}'"))?,
            ),
            Self::Choice(choices) => {
                if !choices.contains(&s) {
                    return Err(format!(
                        "expected one of {}, found '{s}'",
                        choices.join(", ")
                    ));
                }
                PyValue::Str(s.to_owned())
            }
            Self::DynamoBackend => {
                dynamo_backend(s)?;
                PyValue::Str(s.to_owned())
            }
            Self::PyBool => PyValue::Bool(!s.is_empty()),
            Self::StrToBool => PyValue::Int(str_to_bool(s)?),
            Self::BoolTriple => PyValue::List(
                s.split(',')
                    .map(|b| str_to_bool(b).map(PyValue::Int))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }
}

/// Accelerate's `str_to_bool`: 1 or 0.
pub(super) fn str_to_bool(s: &str) -> Result<i64, String> {
    match s.to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Ok(1),
        "n" | "no" | "f" | "false" | "off" | "0" => Ok(0),
        _ => Err(format!("expected true or false, found '{s}'")),
    }
}

/// A TorchDynamo backend as ACCELERATE_DYNAMO_BACKEND spells it (upper case).
pub(super) fn dynamo_backend(s: &str) -> Result<String, String> {
    let upper = s.to_ascii_uppercase();
    if DYNAMO_BACKENDS.contains(&upper.as_str()) {
        Ok(upper)
    } else {
        Err(format!(
            "expected one of {}, found '{s}'",
            DYNAMO_BACKENDS.join(", ").to_ascii_lowercase()
        ))
    }
}

impl Def {
    pub(super) fn value(self, kind: Kind) -> PyValue {
        match self {
            Self::None => PyValue::None,
            Self::Bool(b) => PyValue::Bool(b),
            Self::Int(i) => PyValue::Int(i),
            Self::Float(f) => PyValue::Float(f),
            Self::Str(s) => PyValue::Str(s.to_owned()),
            Self::Parsed(s) => kind.parse(s).unwrap_or(PyValue::None),
        }
    }
}

impl Flag {
    /// The flag as the user types it (`--dynamo_backend`).
    pub(super) fn shown(&self) -> String {
        format!("--{}", self.name)
    }

    /// The clap argument.
    pub(super) fn arg(&'static self) -> Arg {
        let heading = match self.group {
            Group::NoEffect(_) => NO_EFFECT,
            _ => PASSED,
        };
        let mut arg = Arg::new(self.name)
            .long(self.name)
            .help(self.help)
            .help_heading(heading);
        if !self.dash.is_empty() {
            arg = arg.alias(self.dash);
        }
        if let Some(short) = self.short {
            arg = arg.short(short);
        }
        let kind = self.kind;
        let value_name = match kind {
            Kind::Switch => return arg.action(ArgAction::SetTrue),
            Kind::Append if self.name == "env" => {
                return arg.action(ArgAction::Append).value_name("KEY=VALUE");
            }
            Kind::Append => return arg.action(ArgAction::Append).value_name("VALUE"),
            Kind::Int => "N",
            Kind::Float => "X",
            Kind::Choice(_) | Kind::DynamoBackend => "MODE",
            Kind::PyBool | Kind::StrToBool => "BOOL",
            Kind::BoolTriple => "BOOL,BOOL,BOOL",
            Kind::Text => "VALUE",
        };
        arg.action(ArgAction::Set)
            .value_name(value_name)
            .value_parser(move |s: &str| kind.parse(s))
    }
}

/// The row of [`FLAGS`] named `name`.
pub(super) fn row(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.name == name)
}

/// A flag whose name has no `_`, so one spelling serves (`--tpu`, `--env`, `--vm`).
pub(super) fn is_one_word(flag: &Flag) -> bool {
    !flag.name.contains('_')
}

/// Whether `flag` is a command-line flag (and not a config-file key only).
pub(super) fn on_command_line(flag: &Flag) -> bool {
    !flag.dash.is_empty() || flag.short.is_some() || is_one_word(flag)
}
