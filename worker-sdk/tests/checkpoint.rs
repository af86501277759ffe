//! Checkpoints end to end: weights round trips (sharded and not) with every element type,
//! Hugging Face's index layout, atomic replacement and crash leftovers, the whole training
//! state with every kind of registered object, clear errors for bad checkpoints, several ranks
//! saving together through a real coordinator started in-process, and Python's `safetensors`
//! reading what muster wrote.
#![allow(clippy::unwrap_used)]

mod support;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use half::{bf16, f16};
use muster::{
    Accelerator, Error, RankInfo,
    checkpoint::{
        CheckpointState, Checkpoints, DataPosition, MANIFEST_FILE, MODEL_FILE, MODEL_INDEX_FILE,
        StateDict, Stateful, Tensor, load_model, load_state, load_state_as, parse_size, save_model,
        save_state, write_model,
    },
    comm::DType,
    train::{LossScaler, SeededRng},
};
use serde_json::json;
use support::{peers::peers_python, with_accelerators};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A fresh empty directory under the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "muster-checkpoint-{name}-{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The names in `dir`, sorted (hidden ones included).
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn single() -> Accelerator {
    Accelerator::new(RankInfo::single_process()).unwrap()
}

/// `n` deterministic values of `T` made from random bits.
fn values<T: bytemuck::Pod>(rng: &mut SeededRng, n: usize) -> Vec<T> {
    let bytes: Vec<u8> = (0..n * size_of::<T>())
        .map(|_| rng.next_u64() as u8)
        .collect();
    bytemuck::pod_collect_to_vec(&bytes)
}

/// A state dict with every element type, scalars, empty tensors and a few bigger ones.
fn every_kind_of_tensor(seed: u64) -> StateDict {
    let mut rng = SeededRng::new(seed);
    let mut dict = StateDict::new();
    dict.insert(
        "encoder.weight",
        Tensor::from_slice(&[8, 4], &values::<f32>(&mut rng, 32)).unwrap(),
    );
    dict.insert("encoder.bias", Tensor::vector(&values::<f64>(&mut rng, 5)));
    dict.insert(
        "half",
        Tensor::from_slice(&[3, 1, 2], &values::<f16>(&mut rng, 6)).unwrap(),
    );
    dict.insert(
        "brain",
        Tensor::from_slice(&[2, 7], &values::<bf16>(&mut rng, 14)).unwrap(),
    );
    dict.insert("count", Tensor::scalar(-42i32));
    dict.insert("steps", Tensor::scalar(i64::MAX - 3));
    dict.insert("mask", Tensor::vector(&values::<u8>(&mut rng, 13)));
    dict.insert("empty", Tensor::from_slice::<f32>(&[0], &[]).unwrap());
    dict.insert("empty.2d", Tensor::zeros(DType::BF16, &[4, 0]).unwrap());
    dict.insert("scalar.f64", Tensor::scalar(std::f64::consts::PI));
    dict.insert(
        "big.i64",
        Tensor::from_slice(&[16, 4], &values::<i64>(&mut rng, 64)).unwrap(),
    );
    dict
}

fn assert_same_tensors(got: &StateDict, expected: &StateDict) {
    let names = |d: &StateDict| {
        let mut n: Vec<String> = d.names().map(str::to_owned).collect();
        n.sort();
        n
    };
    assert_eq!(names(got), names(expected));
    for (name, tensor) in expected.iter() {
        let found = got.get(name).unwrap();
        assert_eq!(found.dtype(), tensor.dtype(), "{name}");
        assert_eq!(found.shape(), tensor.shape(), "{name}");
        assert_eq!(found.bytes(), tensor.bytes(), "{name}");
    }
}

fn index_of(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(MODEL_INDEX_FILE)).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------------

#[test]
fn unsharded_weights_round_trip_every_type_and_shape() {
    let tmp = TempDir::new("unsharded");
    let dir = tmp.join("model");
    let weights = every_kind_of_tensor(1);
    save_model(&single(), &dir, &weights, parse_size("5GB").unwrap()).unwrap();
    assert_eq!(listing(&dir), [MODEL_FILE]);
    let loaded = load_model(&dir).unwrap();
    assert_same_tensors(&loaded, &weights);
    assert_eq!(loaded, weights);
    // Typed access round-trips too.
    // (Compared by bits: random bits include NaNs.)
    let bits = |d: &StateDict| -> Vec<u16> {
        let values = d.get("brain").unwrap().to_vec::<bf16>().unwrap();
        values.iter().map(|v| v.to_bits()).collect()
    };
    assert_eq!(bits(&loaded), bits(&weights));
    assert_eq!(
        loaded.get("steps").unwrap().to_vec::<i64>().unwrap(),
        [i64::MAX - 3]
    );
    assert!(loaded.get("steps").unwrap().shape().is_empty());
}

#[test]
fn sharded_weights_round_trip_and_respect_the_limit() {
    let tmp = TempDir::new("sharded");
    let dir = tmp.join("model");
    let weights = every_kind_of_tensor(2);
    let limit = 100;
    write_model(&dir, &weights, limit).unwrap();
    let files = listing(&dir);
    let shards: Vec<&String> = files.iter().filter(|f| *f != MODEL_INDEX_FILE).collect();
    let count = shards.len();
    assert!(count > 2, "{files:?}");
    for (i, shard) in shards.iter().enumerate() {
        assert_eq!(
            **shard,
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        );
    }
    assert!(!files.contains(&MODEL_FILE.to_owned()));
    // Every shard holds at most `limit` bytes of tensors, unless it holds one tensor alone.
    let index = index_of(&dir);
    let mut per_shard: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (tensor, shard) in index["weight_map"].as_object().unwrap() {
        per_shard
            .entry(shard.as_str().unwrap().to_owned())
            .or_default()
            .push(tensor.clone());
    }
    assert_eq!(per_shard.len(), count);
    for (shard, tensors) in &per_shard {
        let bytes: usize = tensors
            .iter()
            .map(|t| weights.get(t).unwrap().nbytes())
            .sum();
        assert!(
            bytes <= limit as usize || tensors.len() == 1,
            "{shard}: {tensors:?}"
        );
    }
    assert_eq!(
        index["metadata"]["total_size"].as_u64().unwrap(),
        weights.total_size()
    );
    assert_same_tensors(&load_model(&dir).unwrap(), &weights);
}

#[test]
fn the_index_has_hugging_faces_exact_layout() {
    let tmp = TempDir::new("index");
    let dir = tmp.join("model");
    let weights = StateDict::new()
        .with("b", Tensor::vector(&[1.0f32, 2.0, 3.0, 4.0]))
        .with("a", Tensor::vector(&[5.0f32, 6.0, 7.0, 8.0]))
        .with("c", Tensor::vector(&[9.0f32, 10.0]));
    write_model(&dir, &weights, 32).unwrap();
    assert_eq!(
        listing(&dir),
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            MODEL_INDEX_FILE
        ]
    );
    // What transformers writes: json.dumps(index, indent=2, sort_keys=True) + "\n".
    let expected = r#"{
  "metadata": {
    "total_size": 40
  },
  "weight_map": {
    "a": "model-00001-of-00002.safetensors",
    "b": "model-00001-of-00002.safetensors",
    "c": "model-00002-of-00002.safetensors"
  }
}
"#;
    assert_eq!(
        std::fs::read_to_string(dir.join(MODEL_INDEX_FILE)).unwrap(),
        expected
    );
    // Insertion order decides the shards: b and a fill the first, c starts the second.
    let loaded = load_model(&dir).unwrap();
    assert_eq!(loaded, weights);
    assert_eq!(
        loaded.get("c").unwrap().to_vec::<f32>().unwrap(),
        [9.0, 10.0]
    );
}

#[test]
fn a_tensor_larger_than_the_limit_gets_a_shard_of_its_own() {
    let tmp = TempDir::new("big");
    let dir = tmp.join("model");
    let weights = StateDict::new()
        .with("small.1", Tensor::vector(&[1u8; 8]))
        .with("huge", Tensor::vector(&[2u8; 100]))
        .with("small.2", Tensor::vector(&[3u8; 8]))
        .with("also.huge", Tensor::vector(&[4.0f64; 10]));
    write_model(&dir, &weights, 32).unwrap();
    let index = index_of(&dir);
    let map = &index["weight_map"];
    // As huggingface_hub cuts them: each oversized tensor at once, the open shard last.
    assert_eq!(map["huge"], "model-00001-of-00003.safetensors");
    assert_eq!(map["also.huge"], "model-00002-of-00003.safetensors");
    assert_eq!(map["small.1"], "model-00003-of-00003.safetensors");
    assert_eq!(map["small.2"], "model-00003-of-00003.safetensors");
    assert_eq!(load_model(&dir).unwrap(), weights);
    // One tensor over the limit and nothing else: a single file, no index.
    let alone = tmp.join("alone");
    write_model(
        &alone,
        &StateDict::new().with("x", Tensor::vector(&[0u8; 64])),
        8,
    )
    .unwrap();
    assert_eq!(listing(&alone), [MODEL_FILE]);
}

#[test]
fn saving_weights_again_replaces_them_whole_and_keeps_other_files() {
    let tmp = TempDir::new("replace-weights");
    let dir = tmp.join("model");
    let sharded = every_kind_of_tensor(3);
    write_model(&dir, &sharded, 64).unwrap();
    std::fs::write(dir.join("config.json"), "{\"hidden\": 4}").unwrap();
    let small = StateDict::new().with("only", Tensor::scalar(1.5f32));
    write_model(&dir, &small, 64).unwrap();
    // No stale shard or index survives; config.json does.
    assert_eq!(listing(&dir), ["config.json", MODEL_FILE]);
    assert_eq!(load_model(&dir).unwrap(), small);
    assert_eq!(listing(&tmp.0), ["model"]);
}

// ---------------------------------------------------------------------------------------------
// Training state
// ---------------------------------------------------------------------------------------------

/// An Adam-like optimizer: moments as tensors, the step count and hyperparameters as metadata.
#[derive(Debug, Clone, PartialEq)]
struct Adam {
    step: u64,
    lr: f64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<bf16>,
}

impl Stateful for Adam {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new()
            .with("exp_avg", Tensor::from_slice(&[2, 3], &self.exp_avg)?)
            .with("exp_avg_sq", Tensor::vector(&self.exp_avg_sq))
            .with_metadata(&json!({ "step": self.step, "lr": self.lr }))
    }

    fn load(&mut self, mut state: StateDict) -> Result<(), Error> {
        self.exp_avg = state.take("exp_avg", &[2, 3])?;
        self.exp_avg_sq = state.take("exp_avg_sq", &[self.exp_avg_sq.len()])?;
        #[derive(serde::Deserialize)]
        struct Meta {
            step: u64,
            lr: f64,
        }
        let meta: Meta = state.metadata_as()?;
        (self.step, self.lr) = (meta.step, meta.lr);
        Ok(())
    }
}

/// A scheduler whose state is JSON only.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Cosine {
    last_epoch: i64,
    base_lrs: Vec<f64>,
}

impl Stateful for Cosine {
    fn save(&self) -> Result<StateDict, Error> {
        StateDict::new().with_metadata(self)
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        *self = state.metadata_as()?;
        Ok(())
    }
}

/// Everything a training run checkpoints, with values that depend on `seed`.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    model: StateDict,
    head: StateDict,
    adam: Adam,
    scheduler: Cosine,
    scaler: LossScaler,
    position: DataPosition,
    rng: SeededRng,
    counters: Cosine,
    ema: StateDict,
}

impl Run {
    fn new(seed: u64) -> Self {
        let mut rng = SeededRng::new(seed);
        let mut scaler = LossScaler::default();
        scaler.set_state(1024.0 * seed as f32, seed as u32);
        Self {
            model: every_kind_of_tensor(seed),
            head: StateDict::new()
                .with(
                    "head.weight",
                    Tensor::from_slice(&[4, 4], &values::<f32>(&mut rng, 16)).unwrap(),
                )
                .with("head.bias", Tensor::vector(&values::<f16>(&mut rng, 4))),
            adam: Adam {
                step: seed * 10,
                lr: 1e-3 / seed as f64,
                exp_avg: values(&mut rng, 6),
                exp_avg_sq: values(&mut rng, 5),
            },
            scheduler: Cosine {
                last_epoch: seed as i64,
                base_lrs: vec![0.1, seed as f64],
            },
            scaler,
            position: DataPosition {
                epoch: seed,
                step: seed * 7,
            },
            rng: SeededRng::new(seed * 1000),
            counters: Cosine {
                last_epoch: -(seed as i64),
                base_lrs: vec![],
            },
            ema: StateDict::new()
                .with("ema.shadow", Tensor::vector(&values::<f64>(&mut rng, 3)))
                .with_metadata(&json!({ "decay": 0.999 }))
                .unwrap(),
        }
    }

    /// Registers every object; `head` shards past `shard` bytes.
    fn register<'a>(&'a mut self, state: &mut CheckpointState<'a>) {
        state
            .register_model("model", &mut self.model)
            .register_model("head", &mut self.head)
            .register_optimizer("adam", &mut self.adam)
            .register_scheduler("cosine", &mut self.scheduler)
            .register_scaler("scaler", &mut self.scaler)
            .register_data_position("train", &mut self.position)
            .register_rng("shuffle", &mut self.rng)
            .register_custom("counters", &mut self.counters)
            .register_custom("ema", &mut self.ema);
    }
}

fn save_run(accelerator: &Accelerator, dir: &Path, run: &mut Run, shard: u64) {
    let mut state = CheckpointState::new();
    state.set_max_shard_size(shard);
    run.register(&mut state);
    save_state(accelerator, dir, &state).unwrap();
}

fn load_run(accelerator: &Accelerator, dir: &Path, run: &mut Run) -> Result<(), Error> {
    let mut state = CheckpointState::new();
    run.register(&mut state);
    load_state(accelerator, dir, &mut state)
}

#[test]
fn the_whole_training_state_round_trips() {
    let tmp = TempDir::new("state");
    let dir = tmp.join("checkpoint");
    let accelerator = single();
    let mut saved = Run::new(3);
    save_run(&accelerator, &dir, &mut saved, 2000);
    // The model fits in one file; "head" (model_1) has 72 bytes: unsharded as well.
    assert_eq!(
        listing(&dir),
        [
            "custom_checkpoint_0.json",
            "custom_checkpoint_1.safetensors",
            "data_position.json",
            "model.safetensors",
            "model_1.safetensors",
            MANIFEST_FILE,
            "optimizer.safetensors",
            "random_states_0.json",
            "scaler.json",
            "scheduler.json",
        ]
    );
    let position: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("data_position.json")).unwrap()).unwrap();
    assert_eq!(position, json!({ "epoch": 3, "step": 21 }));
    let rngs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("random_states_0.json")).unwrap()).unwrap();
    assert_eq!(rngs, json!({ "shuffle": { "state": 3000 } }));
    // The same state gives the same bytes, file by file.
    let again = tmp.join("again");
    save_run(&accelerator, &again, &mut saved.clone(), 2000);
    assert_eq!(listing(&again), listing(&dir));
    for file in listing(&dir) {
        let bytes = |d: &Path| std::fs::read(d.join(&file)).unwrap();
        assert!(bytes(&again) == bytes(&dir), "{file} differs");
    }

    // Training goes on: every object changes. Loading brings all of them back.
    let mut run = saved.clone();
    run.rng.next_u64();
    run.adam.step += 1;
    run.adam.exp_avg[0] += 1.0;
    run.scheduler.last_epoch += 1;
    run.scaler.set_state(1.0, 0);
    run.position.step += 1;
    run.counters.base_lrs.push(1.0);
    run.ema.set_metadata(json!(null));
    run.model
        .insert("count", Tensor::scalar(0i32))
        .expect("a template tensor");
    assert_ne!(run, saved);
    load_run(&accelerator, &dir, &mut run).unwrap();
    assert_eq!(run, saved);
    // The generator continues where the saved one stopped.
    assert_eq!(run.rng.next_u64(), saved.clone().rng.next_u64());

    // Registration order does not matter: objects are found by kind and name.
    let mut other = Run::new(4);
    let mut state = CheckpointState::new();
    state
        .register_custom("ema", &mut other.ema)
        .register_rng("shuffle", &mut other.rng)
        .register_custom("counters", &mut other.counters);
    load_state(&accelerator, &dir, &mut state).unwrap();
    assert_eq!(other.ema, saved.ema);
    assert_eq!(other.rng, saved.rng);
    assert_eq!(other.counters, saved.counters);
}

#[test]
fn models_in_a_checkpoint_shard_like_saved_weights() {
    let tmp = TempDir::new("state-sharded");
    let dir = tmp.join("checkpoint");
    let accelerator = single();
    let mut saved = Run::new(5);
    save_run(&accelerator, &dir, &mut saved, 64);
    let files = listing(&dir);
    assert!(files.contains(&MODEL_INDEX_FILE.to_owned()), "{files:?}");
    assert!(
        files.contains(&"model_1.safetensors.index.json".to_owned()),
        "{files:?}"
    );
    assert!(
        files.contains(&"model_1-00001-of-00002.safetensors".to_owned()),
        "{files:?}"
    );
    assert!(!files.contains(&MODEL_FILE.to_owned()), "{files:?}");
    // The checkpoint's model directory is also a Hugging Face weights directory.
    assert_same_tensors(&load_model(&dir).unwrap(), &saved.model);
    let mut run = Run::new(6);
    load_run(&accelerator, &dir, &mut run).unwrap();
    assert_eq!(run, saved);
}

/// Saves a good checkpoint, breaks it with `damage`, loads it with `load` and returns the
/// error.
fn load_error(
    damage: impl FnOnce(&Path),
    load: impl FnOnce(&mut Run, &Path) -> Result<(), Error>,
) -> String {
    let tmp = TempDir::new("bad");
    let dir = tmp.join("checkpoint");
    save_run(&single(), &dir, &mut Run::new(7), 64);
    damage(&dir);
    let mut run = Run::new(8);
    let error = load(&mut run, &dir).unwrap_err();
    assert!(
        matches!(error, Error::Checkpoint(_) | Error::Io { .. }),
        "{error:?}"
    );
    error.to_string()
}

fn load_all(run: &mut Run, dir: &Path) -> Result<(), Error> {
    load_run(&single(), dir, run)
}

#[test]
fn bad_checkpoints_give_errors_that_name_the_file_and_the_tensor() {
    let check = |damage: &dyn Fn(&Path), expected: &[&str]| {
        let error = load_error(|dir| damage(dir), load_all);
        for part in expected {
            assert!(error.contains(part), "{error:?} lacks {part:?}");
        }
    };
    check(
        &|dir| std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap(),
        &["not a complete muster checkpoint", MANIFEST_FILE],
    );
    check(
        &|dir| std::fs::remove_file(dir.join("optimizer.safetensors")).unwrap(),
        &["optimizer.safetensors", "missing"],
    );
    check(
        &|dir| {
            let shard = index_of(dir)["weight_map"]["encoder.weight"].clone();
            std::fs::remove_file(dir.join(shard.as_str().unwrap())).unwrap();
        },
        &["model-0000", "missing"],
    );
    check(
        &|dir| std::fs::remove_file(dir.join("scheduler.json")).unwrap(),
        &["scheduler.json", "missing"],
    );
    check(
        &|dir| std::fs::write(dir.join("optimizer.safetensors"), b"garbage").unwrap(),
        &["optimizer.safetensors", "not a valid safetensors file"],
    );
    check(
        &|dir| std::fs::write(dir.join("scheduler.json"), b"{\"nope\": 1}").unwrap(),
        &["scheduler.json", "cosine", "last_epoch"],
    );
    check(
        &|dir| std::fs::remove_dir_all(dir).unwrap(),
        &["does not exist"],
    );

    // The checkpoint holds a differently shaped or typed tensor than the object expects.
    let wrong_shape = load_error(
        |_| {},
        |run, dir| {
            run.model.insert(
                "encoder.weight",
                Tensor::zeros(DType::F32, &[4, 8]).unwrap(),
            );
            load_all(run, dir)
        },
    );
    for part in [
        "model.safetensors.index.json",
        "model 'model'",
        "tensor 'encoder.weight'",
        "f32 [8, 4]",
        "f32 [4, 8]",
    ] {
        assert!(wrong_shape.contains(part), "{wrong_shape:?} lacks {part:?}");
    }
    let wrong_type = load_error(
        |_| {},
        |run, dir| {
            run.adam.exp_avg_sq = vec![];
            let mut state = CheckpointState::new();
            state.register_optimizer("adam", &mut run.adam);
            load_state_as(dir, 0, &mut state)
        },
    );
    for part in ["optimizer.safetensors", "tensor 'exp_avg_sq'", "[5]", "[0]"] {
        assert!(wrong_type.contains(part), "{wrong_type:?} lacks {part:?}");
    }
    let bf16_as_f16 = load_error(
        |_| {},
        |run, dir| {
            run.model
                .insert("brain", Tensor::zeros(DType::F16, &[2, 7]).unwrap());
            load_all(run, dir)
        },
    );
    assert!(
        bf16_as_f16.contains("tensor 'brain'")
            && bf16_as_f16.contains("bf16 [2, 7] where f16 [2, 7]"),
        "{bf16_as_f16}"
    );
    let extra = load_error(
        |_| {},
        |run, dir| {
            run.model.remove("mask");
            load_all(run, dir)
        },
    );
    assert!(extra.contains("unexpected tensor 'mask'"), "{extra}");

    // An object the checkpoint does not hold, and a rank it has no generator for.
    let unknown = load_error(
        |_| {},
        |run, dir| {
            let mut state = CheckpointState::new();
            state.register_optimizer("sgd", &mut run.adam);
            load_state_as(dir, 0, &mut state)
        },
    );
    assert!(
        unknown.contains("no optimizer named 'sgd'") && unknown.contains("'adam'"),
        "{unknown}"
    );
    let rank = load_error(
        |_| {},
        |run, dir| {
            let mut state = CheckpointState::new();
            state.register_rng("shuffle", &mut run.rng);
            load_state_as(dir, 3, &mut state)
        },
    );
    assert!(
        rank.contains("rank 3") && rank.contains("1 processes"),
        "{rank}"
    );
}

#[test]
fn registering_two_objects_of_a_kind_under_one_name_is_refused() {
    let tmp = TempDir::new("dup");
    let (mut a, mut b) = (SeededRng::new(1), SeededRng::new(2));
    let mut state = CheckpointState::new();
    state
        .register_rng("rng", &mut a)
        .register_rng("rng", &mut b);
    let error = save_state(&single(), tmp.join("x"), &state).unwrap_err();
    assert!(matches!(error, Error::Usage(_)), "{error:?}");
    assert!(!tmp.join("x").exists());
}

// ---------------------------------------------------------------------------------------------
// Atomicity
// ---------------------------------------------------------------------------------------------

#[test]
fn crash_leftovers_are_never_read_and_the_next_save_cleans_them() {
    let tmp = TempDir::new("crash");
    let accelerator = single();
    let mut checkpoints = Checkpoints::new(&tmp.0).unwrap();
    let mut run = Run::new(9);
    let first = {
        let mut state = CheckpointState::new();
        run.register(&mut state);
        checkpoints.save(&accelerator, &state).unwrap()
    };
    assert_eq!(first, tmp.join("checkpoints/checkpoint_0"));
    // A crash mid-save leaves a half-written temporary directory, and a crash of another
    // process a non-hidden directory without a manifest.
    let root = checkpoints.root().to_path_buf();
    let temp = root.join(".checkpoint_1.tmp-g1");
    std::fs::create_dir_all(&temp).unwrap();
    std::fs::write(temp.join("model.safetensors"), b"half").unwrap();
    std::fs::create_dir_all(root.join("checkpoint_5")).unwrap();
    std::fs::write(root.join("checkpoint_5/optimizer.safetensors"), b"x").unwrap();
    // Neither is a checkpoint.
    assert_eq!(checkpoints.list().unwrap(), [(0, first.clone())]);
    assert_eq!(Checkpoints::new(&tmp.0).unwrap().next_iteration(), 1);
    let mut loaded = Run::new(10);
    let mut state = CheckpointState::new();
    loaded.register(&mut state);
    assert_eq!(
        checkpoints.load_latest(&accelerator, &mut state).unwrap(),
        Some(first.clone())
    );
    assert_eq!(loaded, run);
    let error = load_run(&accelerator, &root.join("checkpoint_5"), &mut Run::new(1)).unwrap_err();
    assert!(error.to_string().contains("not a complete"), "{error}");
    let error = load_run(&accelerator, &temp, &mut Run::new(1)).unwrap_err();
    assert!(error.to_string().contains("not a complete"), "{error}");
    // The next save cleans the hidden leftovers.
    let mut state = CheckpointState::new();
    run.register(&mut state);
    let second = checkpoints.save(&accelerator, &state).unwrap();
    assert_eq!(second, root.join("checkpoint_1"));
    assert_eq!(
        listing(&root),
        ["checkpoint_0", "checkpoint_1", "checkpoint_5"]
    );
}

#[test]
fn an_existing_checkpoint_is_replaced_only_whole() {
    let tmp = TempDir::new("replace");
    let dir = tmp.join("ckpt");
    let accelerator = single();
    let mut old = Run::new(11);
    save_run(&accelerator, &dir, &mut old, 64);
    let old_files = listing(&dir);
    // A new save with fewer files (unsharded, no custom objects) replaces the directory.
    let mut new = Run::new(12);
    {
        let mut state = CheckpointState::new();
        state
            .register_model("model", &mut new.model)
            .register_rng("shuffle", &mut new.rng);
        save_state(&accelerator, &dir, &state).unwrap();
    }
    assert_eq!(
        listing(&dir),
        [MODEL_FILE, MANIFEST_FILE, "random_states_0.json"]
    );
    assert_ne!(listing(&dir), old_files);
    assert_eq!(listing(&tmp.0), ["ckpt"]);
    assert_same_tensors(&load_model(&dir).unwrap(), &new.model);

    // A crash between moving the old checkpoint aside and renaming the new one into place
    // leaves only the aside copy: loading reads it, the next save puts it back first.
    let aside = tmp.join(".ckpt.old-1-2");
    std::fs::rename(&dir, &aside).unwrap();
    let mut back = Run::new(13);
    let mut state = CheckpointState::new();
    state.register_model("model", &mut back.model);
    load_state(&accelerator, &dir, &mut state).unwrap();
    assert_eq!(back.model, new.model);
    let other = tmp.join("other");
    save_run(&accelerator, &other, &mut Run::new(14), 1 << 20);
    let mut state = CheckpointState::new();
    state.register_model("model", &mut back.model);
    save_state(&accelerator, &dir, &state).unwrap();
    assert_eq!(listing(&tmp.0), ["ckpt", "other"]);
}

#[test]
fn automatic_naming_counts_up_and_keeps_the_newest() {
    let tmp = TempDir::new("auto");
    let accelerator = single();
    let mut checkpoints = Checkpoints::new(&tmp.0).unwrap().with_total_limit(2);
    assert_eq!(checkpoints.latest().unwrap(), None);
    let mut rng = SeededRng::new(0);
    for i in 0..4u64 {
        rng.next_u64();
        let mut state = CheckpointState::new();
        state.register_rng("rng", &mut rng);
        let dir = checkpoints.save(&accelerator, &state).unwrap();
        assert_eq!(dir, checkpoints.root().join(format!("checkpoint_{i}")));
    }
    let kept: Vec<u64> = checkpoints
        .list()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(kept, [2, 3]);
    assert_eq!(
        listing(checkpoints.root()),
        ["checkpoint_2", "checkpoint_3"]
    );
    // A restarted run continues the numbering and resumes from the newest.
    let mut restarted = Checkpoints::new(&tmp.0).unwrap();
    assert_eq!(restarted.next_iteration(), 4);
    let mut resumed = SeededRng::new(99);
    let mut state = CheckpointState::new();
    state.register_rng("rng", &mut resumed);
    let latest = restarted.load_latest(&accelerator, &mut state).unwrap();
    assert_eq!(latest, Some(checkpoints.root().join("checkpoint_3")));
    assert_eq!(resumed, rng);
}

// ---------------------------------------------------------------------------------------------
// Several ranks
// ---------------------------------------------------------------------------------------------

/// A custom object that records which ranks saved it.
struct Witness {
    rank: usize,
    savers: Arc<Mutex<Vec<usize>>>,
    value: i64,
}

impl Stateful for Witness {
    fn save(&self) -> Result<StateDict, Error> {
        self.savers.lock().unwrap().push(self.rank);
        StateDict::new().with_metadata(&self.value)
    }

    fn load(&mut self, state: StateDict) -> Result<(), Error> {
        self.value = state.metadata_as()?;
        Ok(())
    }
}

#[test]
fn ranks_save_together_and_every_rank_can_load_when_save_returns() {
    let tmp = Arc::new(TempDir::new("ranks"));
    let savers = Arc::new(Mutex::new(Vec::new()));
    let results = {
        let (tmp, savers) = (tmp.clone(), savers.clone());
        with_accelerators("checkpoint-ranks", &[2, 1], move |accelerator| {
            let rank = accelerator.process_index();
            let dir = tmp.join("ckpt");
            let model = every_kind_of_tensor(21);
            let mut run_model = model.clone();
            let mut rng = SeededRng::new(100 + rank as u64);
            rng.next_u64();
            let mut position = DataPosition { epoch: 1, step: 5 };
            let mut witness = Witness {
                rank,
                savers: savers.clone(),
                value: 77,
            };
            {
                let mut state = CheckpointState::new();
                state
                    .set_max_shard_size(128)
                    .register_model("model", &mut run_model)
                    .register_rng("rng", &mut rng)
                    .register_data_position("data", &mut position)
                    .register_custom("witness", &mut witness);
                save_state(&accelerator, &dir, &state).unwrap();
            }
            // Right after the save returns, every rank reads the whole checkpoint.
            let mut loaded_rng = SeededRng::new(0);
            let mut loaded_model = StateDict::new();
            let mut loaded_position = DataPosition::default();
            let mut loaded_witness = Witness {
                rank,
                savers: Arc::new(Mutex::new(Vec::new())),
                value: 0,
            };
            let mut state = CheckpointState::new();
            state
                .register_model("model", &mut loaded_model)
                .register_rng("rng", &mut loaded_rng)
                .register_data_position("data", &mut loaded_position)
                .register_custom("witness", &mut loaded_witness);
            load_state(&accelerator, &dir, &mut state).unwrap();
            drop(state);
            assert_eq!(loaded_rng, rng, "rank {rank}");
            assert_eq!(loaded_model, model);
            assert_eq!(loaded_position, position);
            assert_eq!(loaded_witness.value, 77);

            // Saved weights and automatic naming work across ranks too.
            save_model(&accelerator, tmp.join("weights"), &model, 200).unwrap();
            assert_same_tensors(&load_model(tmp.join("weights")).unwrap(), &model);
            let mut checkpoints = Checkpoints::new(tmp.join("project"))
                .unwrap()
                .with_total_limit(1);
            let mut saved = Vec::new();
            for _ in 0..2 {
                rng.next_u64();
                let mut state = CheckpointState::new();
                state.register_rng("rng", &mut rng);
                saved.push(checkpoints.save(&accelerator, &state).unwrap());
            }
            let mut resumed = SeededRng::new(0);
            let mut state = CheckpointState::new();
            state.register_rng("rng", &mut resumed);
            let latest = checkpoints.load_latest(&accelerator, &mut state).unwrap();
            assert_eq!(resumed, rng, "rank {rank}");
            accelerator.finish().unwrap();
            (saved, latest)
        })
    };
    // Only the main process saved the shared objects.
    assert_eq!(*savers.lock().unwrap(), [0]);
    let dir = tmp.join("ckpt");
    let files = listing(&dir);
    for rank in 0..3 {
        assert!(
            files.contains(&format!("random_states_{rank}.json")),
            "{files:?}"
        );
    }
    assert!(files.contains(&MODEL_INDEX_FILE.to_owned()), "{files:?}");
    assert_eq!(listing(&tmp.0), ["ckpt", "project", "weights"]);
    // Every rank agreed on the automatic names.
    for (saved, latest) in &results {
        assert_eq!(saved, &results[0].0);
        assert_eq!(latest.as_ref(), saved.last());
    }
    assert_eq!(listing(&tmp.join("project/checkpoints")), ["checkpoint_1"]);
}

#[test]
fn a_failure_of_the_main_process_reaches_every_rank() {
    let tmp = Arc::new(TempDir::new("ranks-fail"));
    // The checkpoint's parent is a file: the main process cannot create the directory.
    std::fs::write(tmp.join("file"), b"not a directory").unwrap();
    let errors = {
        let tmp = tmp.clone();
        with_accelerators("checkpoint-fail", &[3], move |accelerator| {
            let mut rng = SeededRng::new(1);
            let mut state = CheckpointState::new();
            state.register_rng("rng", &mut rng);
            let error = save_state(&accelerator, tmp.join("file/ckpt"), &state).unwrap_err();
            // The ranks stay in step: the next collective call works.
            accelerator.wait_for_everyone().unwrap();
            accelerator.finish().unwrap();
            error
        })
    };
    assert!(matches!(errors[0], Error::Io { .. }), "{:?}", errors[0]);
    for error in &errors[1..] {
        let message = error.to_string();
        assert!(
            message.contains("the main process failed to prepare the checkpoint")
                && message.contains("file"),
            "{message}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Python
// ---------------------------------------------------------------------------------------------

/// FNV-1a, 64 bits: the checksum `read_safetensors.py` prints.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What `read_safetensors.py` prints for `weights`: one sorted line per tensor.
fn expected_report(weights: &StateDict) -> String {
    let mut lines: Vec<String> = weights
        .iter()
        .map(|(name, t)| {
            format!(
                "{name}\t{}\t{:?}\t{:016x}",
                t.dtype(),
                t.shape(),
                fnv1a(t.bytes())
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

#[test]
fn python_safetensors_reads_what_muster_writes() {
    let Some(python) = peers_python(&["safetensors", "torch"]) else {
        return;
    };
    let tmp = TempDir::new("python");
    let weights = every_kind_of_tensor(31);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/read_safetensors.py");
    for (name, limit) in [("unsharded", u64::MAX), ("sharded", 100)] {
        let dir = tmp.join(name);
        write_model(&dir, &weights, limit).unwrap();
        let output = std::process::Command::new(&python)
            .arg(&script)
            .arg(&dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{name}: {}\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let mut expected = expected_report(&weights);
        if limit != u64::MAX {
            expected = format!("total_size\t{}\n{expected}", weights.total_size());
        }
        assert_eq!(stdout.trim_end(), expected, "{name}");
    }
}
