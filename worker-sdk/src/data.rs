//! Accelerate-exact data sharding: which items each rank sees at each step, and
//! `gather_for_metrics`.
//!
//! Hugging Face Accelerate's `accelerator.prepare(dataloader)` gives every process its own
//! share of each epoch; this module reproduces that assignment item for item, so that a job
//! moved from Accelerate to muster (or run side by side with it) trains on the same batches:
//!
//! - [`ShardedSampler`] is Accelerate's `BatchSamplerShard` over an indexable dataset of a
//!   known length: `batch_size`, `drop_last`, `even_batches` (the wrap-around padding from the
//!   start of the epoch), `split_batches`, and seeded shuffling that draws the same permutation
//!   on every rank and a new one per epoch ([`ShardedSampler::set_epoch`]).
//! - [`IterableShard`] is Accelerate's `IterableDatasetShard` over any iterator (streaming
//!   data): it buffers one global batch, hands each rank its slice and pads the final partial
//!   buffer with the first items of the stream.
//! - [`GradientState`] is what `gather_for_metrics` needs to know about the loader: whether
//!   this is its last batch, and the remainder (`dataset length % total batch size`) that says
//!   how many of the last batch's gathered items are real.
//! - [`gather_for_metrics`] gathers every rank's items of a step (any length per rank) through
//!   a [`Communicator`] and drops the padding duplicates of the last batch;
//!   [`metrics_from_gathered`] is its pure half, for ranks' data you already hold.
//!
//! # How the sharding goes (Accelerate's rules)
//!
//! The epoch's order (`0..len`, or a permutation when shuffling) is cut into global batches of
//! `batch_size` items; the last one may be partial.
//!
//! - Default (`split_batches = false`): global batch `i` goes to rank `i % P`; a step is a round
//!   of P batches. With `even_batches` (the default) and without `drop_last`, the last partial
//!   batch is topped up, and more batches are cut, from the start of the epoch (its first
//!   `P * batch_size` items, repeated when the dataset is smaller) until every rank has the same
//!   number of full batches. Without `even_batches` nothing is padded and ranks may end with
//!   different numbers of batches (rank 0 never has fewer than another). With `drop_last`,
//!   partial batches and incomplete rounds are dropped.
//! - `split_batches = true`: `batch_size` is the global batch and must be a multiple of P; rank
//!   `r` gets items `[b*r, b*(r+1))` of every global batch, `b = batch_size / P`. The last
//!   partial batch is padded from the first batch (`even_batches`), or cut as it is (ranks past
//!   its end get nothing that step).
//! - One process (P = 1): Accelerate leaves the loader alone, so batches are plain chunks (the
//!   last one partial unless `drop_last`) whatever `even_batches` says.
//!
//! # Shuffling
//!
//! With [`ShardedSampler::with_shuffle`] the epoch's order is a permutation drawn from
//! [`SeededRng`] seeded with `seed + epoch`: the same on every rank (no communication), a new
//! one after [`ShardedSampler::set_epoch`], like Accelerate's `SeedableRandomSampler`. The
//! permutation itself is **not** bit-for-bit the one torch's `randperm` would draw (torch's
//! Mersenne Twister generator is not reproduced here); given a permutation, the assignment of
//! its items to ranks and steps is Accelerate's exactly.
//!
//! # Where muster differs, on purpose
//!
//! - Without `even_batches`, Accelerate's `gather` needs the same shapes on every process and
//!   hangs when a process has no batch left. Here every rank takes part in every step of the
//!   epoch ([`ShardedSampler::global_len`]), a rank past its last batch with an empty slice,
//!   and [`ShardedSampler::gradient_state`] marks the epoch's last step on every rank (rank 0's
//!   view in Accelerate).
//! - With `split_batches` and without `even_batches`, Accelerate's `len()` counts the last
//!   partial batch on every rank; [`ShardedSampler::len`] counts the batches actually yielded.
//! - [`IterableShard::with_total_len`] gives streams the remainder Accelerate never computes
//!   for them, so their padding can be dropped too.
//!
//! `tests/tests/shard_report.rs` compares all of this with Accelerate's own classes over a grid
//! of lengths, batch sizes, process counts and flags.
//!
//! ```
//! use muster::data::{ShardOptions, ShardedSampler};
//!
//! // 10 items, batches of 4, 2 ranks: the seeds' worked example.
//! let rank0 = ShardedSampler::new(10, ShardOptions::new(4), 2, 0)?;
//! let rank1 = ShardedSampler::new(10, ShardOptions::new(4), 2, 1)?;
//! let batches = |s: &ShardedSampler| s.iter().map(|b| b.indices).collect::<Vec<_>>();
//! assert_eq!(batches(&rank0), [vec![0, 1, 2, 3], vec![8, 9, 0, 1]]);
//! assert_eq!(batches(&rank1), [vec![4, 5, 6, 7], vec![2, 3, 4, 5]]);
//! // At the last step only 10 % 8 = 2 of the 8 gathered items are real.
//! let last = rank0.gradient_state(1);
//! let gathered = muster::data::metrics_from_gathered(&[vec![8, 9, 0, 1], vec![2, 3, 4, 5]], &last);
//! assert_eq!(gathered, [8, 9]);
//! # Ok::<(), muster::Error>(())
//! ```

use crate::Error;
use crate::comm::{Communicator, Element};
use crate::train::SeededRng;

/// How batches are formed and spread over the ranks: the knobs of Accelerate's
/// `DataLoader(batch_size, drop_last)` and `Accelerator(split_batches, even_batches)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardOptions {
    /// Items per batch: per rank, or per step across all ranks with `split_batches`.
    pub batch_size: usize,
    /// Drop incomplete batches (and incomplete rounds of batches) instead of padding them.
    pub drop_last: bool,
    /// Pad the end of the epoch with items from its start so that every rank gets the same
    /// number of full batches (Accelerate's default). Ignored with `drop_last`, with one
    /// process, and by [`IterableShard`] (which always pads, as Accelerate's does).
    pub even_batches: bool,
    /// `batch_size` is the global batch, split evenly between the ranks.
    pub split_batches: bool,
}

impl ShardOptions {
    /// Accelerate's defaults for `batch_size`: keep the last batch, even batches, no splitting.
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            drop_last: false,
            even_batches: true,
            split_batches: false,
        }
    }

    /// Sets [`ShardOptions::drop_last`].
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets [`ShardOptions::even_batches`].
    pub fn even_batches(mut self, even_batches: bool) -> Self {
        self.even_batches = even_batches;
        self
    }

    /// Sets [`ShardOptions::split_batches`].
    pub fn split_batches(mut self, split_batches: bool) -> Self {
        self.split_batches = split_batches;
        self
    }

    /// Items per step across all ranks (Accelerate's `total_batch_size`): `batch_size` with
    /// `split_batches`, else `batch_size * num_processes`.
    pub fn total_batch_size(&self, num_processes: usize) -> usize {
        if self.split_batches {
            self.batch_size
        } else {
            self.batch_size * num_processes
        }
    }

    /// Checks the options for `num_processes` ranks, as Accelerate does when it wraps a loader.
    fn validate(&self, num_processes: usize, process_index: usize) -> Result<(), Error> {
        if self.batch_size == 0 {
            return Err(Error::Usage("the batch size must be at least 1".into()));
        }
        if num_processes == 0 {
            return Err(Error::Usage(
                "the number of processes must be at least 1".into(),
            ));
        }
        if process_index >= num_processes {
            return Err(Error::Usage(format!(
                "process index {process_index} is out of range for {num_processes} processes"
            )));
        }
        if self.split_batches && num_processes > 1 && !self.batch_size.is_multiple_of(num_processes)
        {
            return Err(Error::Usage(format!(
                "with split_batches the batch size ({}) must be a multiple of the number of \
                 processes ({num_processes})",
                self.batch_size
            )));
        }
        Ok(())
    }
}

/// What `gather_for_metrics` needs to know about the loader of the current step: Accelerate's
/// `GradientState` (`end_of_dataloader`, `remainder`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GradientState {
    end_of_dataloader: bool,
    remainder: Option<usize>,
}

impl GradientState {
    /// The state at the start of an epoch, as Accelerate's `DataLoaderStateMixin.begin`
    /// computes it: the remainder is `dataset_len % total_batch_size`, unknown (Accelerate's
    /// -1) when the length is unknown or the loader drops its last batch.
    pub fn begin(dataset_len: Option<usize>, total_batch_size: usize, drop_last: bool) -> Self {
        let remainder = match dataset_len {
            Some(len) if !drop_last && total_batch_size > 0 => Some(len % total_batch_size),
            _ => None,
        };
        Self {
            end_of_dataloader: false,
            remainder,
        }
    }

    /// A state given its two parts.
    pub fn new(end_of_dataloader: bool, remainder: Option<usize>) -> Self {
        Self {
            end_of_dataloader,
            remainder,
        }
    }

    /// The same state at the loader's last batch (or not).
    pub fn at_end(mut self, end_of_dataloader: bool) -> Self {
        self.end_of_dataloader = end_of_dataloader;
        self
    }

    /// Whether the current batch is the loader's last.
    pub fn end_of_dataloader(&self) -> bool {
        self.end_of_dataloader
    }

    /// How many of the last step's gathered items are real (0: all of them); `None` when
    /// unknown, in which case nothing is dropped.
    pub fn remainder(&self) -> Option<usize> {
        self.remainder
    }
}

/// The pure half of [`gather_for_metrics`]: concatenates the ranks' items of one step in rank
/// order and, at the loader's last batch with a remainder above 0, keeps only the first
/// `remainder` items, exactly Accelerate's `data[:remainder]` (the real items come first; the
/// rest are the padding duplicates).
pub fn metrics_from_gathered<T: Clone>(per_rank: &[Vec<T>], state: &GradientState) -> Vec<T> {
    let mut all: Vec<T> = per_rank.iter().flatten().cloned().collect();
    if state.end_of_dataloader
        && let Some(remainder) = state.remainder
        && remainder > 0
    {
        all.truncate(remainder);
    }
    all
}

/// Accelerate's `gather_for_metrics`: every rank's `local` items of this step (lengths may
/// differ between ranks), concatenated in rank order, without the duplicates that padding
/// added to the last batch. Every rank must call it at the same steps (a rank without a batch
/// at a step passes an empty slice), with the same `state`, and gets the same result.
pub fn gather_for_metrics<T: Element>(
    comm: &Communicator,
    local: &[T],
    state: &GradientState,
) -> Result<Vec<T>, Error> {
    let per_rank = comm.all_gather_varlen(local)?;
    Ok(metrics_from_gathered(&per_rank, state))
}

/// How a sampler's ranks divide the global batches (Accelerate's three code paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One process: Accelerate does not wrap the loader.
    Plain,
    /// Global batch `i` goes to rank `i % P`.
    Whole,
    /// Every global batch is split into P slices.
    Split,
}

/// Accelerate's `BatchSamplerShard` over an indexable dataset of a known length: the dataset
/// indices each rank uses at each step of an epoch. Batches are computed on demand, so a
/// sampler over a huge dataset costs nothing until shuffled (the permutation takes one `usize`
/// per item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedSampler {
    dataset_len: usize,
    options: ShardOptions,
    num_processes: usize,
    process_index: usize,
    mode: Mode,
    seed: Option<u64>,
    epoch: u64,
    /// The epoch's order when shuffling (`None`: `0..dataset_len`).
    permutation: Option<Vec<usize>>,
}

impl ShardedSampler {
    /// The sampler of rank `process_index` of `num_processes` over `dataset_len` items, in
    /// order. Fails, naming the problem, when the batch size is 0, the rank is out of range, or
    /// `split_batches` is asked for with a batch size that is not a multiple of the number of
    /// processes (Accelerate raises there too).
    pub fn new(
        dataset_len: usize,
        options: ShardOptions,
        num_processes: usize,
        process_index: usize,
    ) -> Result<Self, Error> {
        options.validate(num_processes, process_index)?;
        let mode = if num_processes == 1 {
            Mode::Plain
        } else if options.split_batches {
            Mode::Split
        } else {
            Mode::Whole
        };
        Ok(Self {
            dataset_len,
            options,
            num_processes,
            process_index,
            mode,
            seed: None,
            epoch: 0,
            permutation: None,
        })
    }

    /// The sampler of this process (its rank and the job's world size).
    pub fn for_accelerator(
        dataset_len: usize,
        options: ShardOptions,
        accelerator: &crate::Accelerator,
    ) -> Result<Self, Error> {
        Self::new(
            dataset_len,
            options,
            accelerator.num_processes(),
            accelerator.process_index(),
        )
    }

    /// Shuffles every epoch with a permutation seeded by `seed + epoch`, the same on every
    /// rank that uses the same seed (see the module's notes on torch's permutation).
    pub fn with_shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self.reshuffle();
        self
    }

    /// Moves to `epoch`: with shuffling, the order becomes the permutation of `seed + epoch`.
    /// Accelerate's loader advances its epoch after each complete pass; here the training loop
    /// calls this at the start of each epoch (as with torch's `DistributedSampler`).
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.epoch != epoch {
            self.epoch = epoch;
            self.reshuffle();
        }
    }

    fn reshuffle(&mut self) {
        self.permutation = self.seed.map(|seed| {
            let mut order: Vec<usize> = (0..self.dataset_len).collect();
            SeededRng::new(seed.wrapping_add(self.epoch)).shuffle(&mut order);
            order
        });
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of items in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// The options this sampler was built with.
    pub fn options(&self) -> ShardOptions {
        self.options
    }

    /// The number of ranks sharing the data.
    pub fn num_processes(&self) -> usize {
        self.num_processes
    }

    /// This sampler's rank.
    pub fn process_index(&self) -> usize {
        self.process_index
    }

    /// The epoch's order of dataset indices, before batching (`0..len` without shuffling).
    pub fn order(&self) -> Vec<usize> {
        match &self.permutation {
            Some(p) => p.clone(),
            None => (0..self.dataset_len).collect(),
        }
    }

    /// Items per step across all ranks (Accelerate's `total_batch_size`).
    pub fn total_batch_size(&self) -> usize {
        self.options.total_batch_size(self.num_processes)
    }

    /// Accelerate's `remainder`: `len % total_batch_size`, `None` with `drop_last`.
    pub fn remainder(&self) -> Option<usize> {
        GradientState::begin(
            Some(self.dataset_len),
            self.total_batch_size(),
            self.options.drop_last,
        )
        .remainder()
    }

    /// The number of batches this rank gets this epoch.
    pub fn len(&self) -> usize {
        self.len_of(self.process_index)
    }

    /// Whether this rank gets no batch at all this epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of steps of the epoch: the most batches any rank gets (rank 0's count). It
    /// differs from [`ShardedSampler::len`] only without `even_batches`.
    pub fn global_len(&self) -> usize {
        self.len_of(0)
    }

    /// The number of global batches the epoch's order is cut into.
    fn global_batches(&self) -> usize {
        if self.options.drop_last {
            self.dataset_len / self.options.batch_size
        } else {
            self.dataset_len.div_ceil(self.options.batch_size)
        }
    }

    /// Whether the end of the epoch is padded from its start.
    fn pads(&self) -> bool {
        self.options.even_batches && !self.options.drop_last
    }

    /// The number of batches rank `rank` gets this epoch.
    ///
    /// Accelerate's `len()` agrees except with `split_batches` and without `even_batches`,
    /// where it counts the last partial batch for every rank although only the ranks its
    /// items reach get a slice of it; this is the number of batches actually yielded.
    pub fn len_of(&self, rank: usize) -> usize {
        let (p, b) = (self.num_processes, self.options.batch_size);
        let n = self.global_batches();
        if rank >= p {
            return 0;
        }
        match self.mode {
            Mode::Plain => n,
            Mode::Whole if self.options.drop_last => n / p,
            Mode::Whole if self.pads() => n.div_ceil(p),
            Mode::Whole => n.saturating_sub(rank).div_ceil(p),
            Mode::Split if self.options.drop_last || self.pads() => n,
            Mode::Split => {
                let tail = self.dataset_len % b;
                self.dataset_len / b + usize::from(tail > (b / p) * rank)
            }
        }
    }

    /// Item `i` of the epoch's padded order: the order itself, then its first `source` items
    /// over and over (Accelerate's `initial_data`, doubled until long enough).
    fn padded_item(&self, i: usize, source: usize) -> usize {
        let position = if i < self.dataset_len {
            i
        } else {
            (i - self.dataset_len) % source
        };
        match &self.permutation {
            Some(p) => p[position],
            None => position,
        }
    }

    /// This rank's batch at `step`, or `None` past its last batch.
    pub fn batch(&self, step: usize) -> Option<Vec<usize>> {
        self.batch_of(self.process_index, step)
    }

    /// Rank `rank`'s batch at `step`, or `None` past its last batch: every rank can compute
    /// every other rank's batches without communication.
    pub fn batch_of(&self, rank: usize, step: usize) -> Option<Vec<usize>> {
        if step >= self.len_of(rank) {
            return None;
        }
        let (l, b, p) = (
            self.dataset_len,
            self.options.batch_size,
            self.num_processes,
        );
        // The range of the padded order this batch covers, and how many items of the epoch's
        // start the padding repeats.
        let (start, end, source) = match self.mode {
            Mode::Plain => (step * b, (step * b + b).min(l), l),
            Mode::Whole => {
                let start = (step * p + rank) * b;
                if self.pads() {
                    (start, start + b, l.min(p * b))
                } else {
                    (start, (start + b).min(l), l)
                }
            }
            Mode::Split => {
                let piece = b / p;
                let start = step * b + piece * rank;
                if self.pads() {
                    (start, start + piece, l.min(b))
                } else {
                    (start, (start + piece).min(l), l)
                }
            }
        };
        Some((start..end).map(|i| self.padded_item(i, source)).collect())
    }

    /// What `gather_for_metrics` needs at `step`: the remainder, and whether `step` is the
    /// epoch's last ([`ShardedSampler::global_len`] - 1, the same on every rank).
    pub fn gradient_state(&self, step: usize) -> GradientState {
        GradientState::begin(
            Some(self.dataset_len),
            self.total_batch_size(),
            self.options.drop_last,
        )
        .at_end(step + 1 == self.global_len())
    }

    /// This rank's batches of the epoch, in order.
    pub fn iter(&self) -> Batches<'_> {
        Batches {
            sampler: self,
            step: 0,
        }
    }
}

impl<'a> IntoIterator for &'a ShardedSampler {
    type Item = Batch;
    type IntoIter = Batches<'a>;

    fn into_iter(self) -> Batches<'a> {
        self.iter()
    }
}

/// One step of a rank's epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The step, from 0.
    pub step: usize,
    /// The dataset indices of this rank's batch.
    pub indices: Vec<usize>,
    /// The state to pass to [`gather_for_metrics`] at this step.
    pub state: GradientState,
}

/// The iterator of [`ShardedSampler::iter`].
#[derive(Debug, Clone)]
pub struct Batches<'a> {
    sampler: &'a ShardedSampler,
    step: usize,
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let indices = self.sampler.batch(self.step)?;
        let step = self.step;
        self.step += 1;
        Some(Batch {
            step,
            indices,
            state: self.sampler.gradient_state(step),
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.sampler.len().saturating_sub(self.step);
        (left, Some(left))
    }
}

impl ExactSizeIterator for Batches<'_> {}

/// Accelerate's `IterableDatasetShard`: this rank's batches of a stream whose length need not
/// be known. It reads one global batch (`batch_size * P` items, or `batch_size` with
/// `split_batches`) and yields this rank's slice of it; the final partial buffer is padded
/// with the stream's first items (dropped with `drop_last`). Like Accelerate's loader it reads
/// one batch ahead, so [`IterableShard::gradient_state`] knows when the batch just returned is
/// the last. With one process the stream is batched plainly (Accelerate does not wrap it): the
/// last batch stays partial. `even_batches` does not apply: every rank always gets the same
/// number of batches. This is Accelerate's path with `dispatch_batches=False`; by default its
/// `prepare` dispatches iterable datasets from rank 0 instead (`DataLoaderDispatcher`), which
/// is not reproduced here.
#[derive(Debug)]
pub struct IterableShard<I: Iterator> {
    inner: I,
    global_batch: usize,
    slice: std::ops::Range<usize>,
    drop_last: bool,
    plain: bool,
    /// The stream's first global batch, the padding's source.
    first: Option<Vec<I::Item>>,
    /// The batch read ahead.
    ahead: Option<Vec<I::Item>>,
    exhausted: bool,
    started: bool,
    end_of_dataloader: bool,
    remainder: Option<usize>,
}

impl<I> IterableShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    /// This rank's shard of `items`. Fails as [`ShardedSampler::new`] does; with
    /// `split_batches` the batch size must be a multiple of `num_processes`.
    pub fn new<S: IntoIterator<IntoIter = I>>(
        items: S,
        options: ShardOptions,
        num_processes: usize,
        process_index: usize,
    ) -> Result<Self, Error> {
        options.validate(num_processes, process_index)?;
        let b = options.batch_size;
        let plain = num_processes == 1;
        let (global_batch, piece) = if plain {
            (b, b)
        } else if options.split_batches {
            (b, b / num_processes)
        } else {
            (b * num_processes, b)
        };
        Ok(Self {
            inner: items.into_iter(),
            global_batch,
            slice: piece * process_index..piece * (process_index + 1),
            drop_last: options.drop_last,
            plain,
            first: None,
            ahead: None,
            exhausted: false,
            started: false,
            end_of_dataloader: false,
            remainder: None,
        })
    }

    /// Declares the stream's total length, so that [`GradientState::remainder`] is known
    /// (`len % global batch`) and `gather_for_metrics` drops the last step's padding.
    /// Accelerate's remainder for its iterable shards is -1 (no length) or 0 (computed from the
    /// per-rank length the shard reports, a multiple of the batch size), so its
    /// `gather_for_metrics` keeps those duplicates; this is the remainder that removes them.
    /// Without this call the state's remainder is unknown and nothing is dropped, as there.
    pub fn with_total_len(mut self, total_len: usize) -> Self {
        self.remainder =
            GradientState::begin(Some(total_len), self.global_batch, self.drop_last).remainder();
        self
    }

    /// The state after the batch last returned: whether it was the stream's last, and the
    /// remainder when [`IterableShard::with_total_len`] declared the length.
    pub fn gradient_state(&self) -> GradientState {
        GradientState::new(self.end_of_dataloader, self.remainder)
    }

    /// Reads the next batch of this rank from the stream.
    fn read(&mut self) -> Option<Vec<I::Item>> {
        if self.exhausted {
            return None;
        }
        let mut buffer = Vec::with_capacity(self.global_batch);
        buffer.extend(self.inner.by_ref().take(self.global_batch));
        if buffer.len() == self.global_batch {
            if self.first.is_none() {
                self.first = Some(buffer.clone());
            }
            return Some(buffer[self.slice.clone()].to_vec());
        }
        self.exhausted = true;
        if buffer.is_empty() || self.drop_last {
            return None;
        }
        if self.plain {
            return Some(buffer);
        }
        let first = self.first.take().unwrap_or_else(|| buffer.clone());
        while buffer.len() < self.global_batch {
            buffer.extend_from_slice(&first);
        }
        Some(buffer[self.slice.clone()].to_vec())
    }
}

impl<I> Iterator for IterableShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    type Item = Vec<I::Item>;

    fn next(&mut self) -> Option<Vec<I::Item>> {
        if !self.started {
            self.started = true;
            self.ahead = self.read();
        }
        let current = self.ahead.take()?;
        self.ahead = self.read();
        self.end_of_dataloader = self.ahead.is_none();
        Some(current)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn opts(b: usize, split: bool, even: bool, drop: bool) -> ShardOptions {
        ShardOptions::new(b)
            .split_batches(split)
            .even_batches(even)
            .drop_last(drop)
    }

    fn all(l: usize, o: ShardOptions, p: usize) -> Vec<Vec<Vec<usize>>> {
        (0..p)
            .map(|r| {
                ShardedSampler::new(l, o, p, r)
                    .unwrap()
                    .iter()
                    .map(|b| b.indices)
                    .collect()
            })
            .collect()
    }

    /// A direct port of Accelerate's `BatchSamplerShard` generators (and of its P = 1
    /// bypass), over `order`, as the reference the closed forms are checked against.
    fn reference(order: &[usize], o: ShardOptions, p: usize, r: usize) -> Vec<Vec<usize>> {
        let b = o.batch_size;
        let mut batches: Vec<Vec<usize>> = order.chunks(b).map(<[usize]>::to_vec).collect();
        if o.drop_last && batches.last().is_some_and(|x| x.len() < b) {
            batches.pop();
        }
        if p == 1 {
            return batches;
        }
        let mut out = Vec::new();
        if o.split_batches {
            let piece = b / p;
            let mut initial: Vec<usize> = Vec::new();
            let mut last: Vec<usize> = Vec::new();
            for (idx, batch) in batches.iter().enumerate() {
                if idx == 0 {
                    initial = batch.clone();
                }
                if batch.len() == b {
                    out.push(batch[piece * r..piece * (r + 1)].to_vec());
                }
                last = batch.clone();
            }
            if !o.drop_last && !initial.is_empty() && last.len() < b {
                if !o.even_batches {
                    if last.len() > piece * r {
                        out.push(last[piece * r..(piece * (r + 1)).min(last.len())].to_vec());
                    }
                } else {
                    // Python's aliasing: with one batch, `initial` *is* `last`.
                    if batches.len() == 1 {
                        while last.len() < b {
                            last.extend(last.clone());
                        }
                        initial = last.clone();
                    } else {
                        while initial.len() < b {
                            initial.extend(initial.clone());
                        }
                    }
                    last.extend(initial);
                    out.push(last[piece * r..piece * (r + 1)].to_vec());
                }
            }
            return out;
        }
        let mut initial: Vec<usize> = Vec::new();
        let mut to_yield: Option<Vec<usize>> = None;
        let mut idx = 0;
        let mut batch: Vec<usize> = Vec::new();
        for (i, bt) in batches.iter().enumerate() {
            idx = i;
            batch = bt.clone();
            if !o.drop_last && i < p {
                initial.extend(bt);
            }
            if i % p == r {
                to_yield = Some(bt.clone());
            }
            if i % p == p - 1 && bt.len() == b {
                out.extend(to_yield.take());
            }
        }
        if !o.drop_last && !initial.is_empty() {
            if !o.even_batches {
                out.extend(to_yield);
            } else {
                if let Some(t) = to_yield.filter(|t| t.len() == b) {
                    out.push(t);
                }
                while initial.len() < p * b {
                    initial.extend(initial.clone());
                }
                if batch.len() == b {
                    batch.clear();
                    idx += 1;
                }
                let mut cycle = 0;
                while idx % p != 0 || !batch.is_empty() {
                    let end = cycle + b - batch.len();
                    batch.extend_from_slice(&initial[cycle..end]);
                    if idx % p == r {
                        out.push(batch.clone());
                    }
                    cycle = end;
                    batch.clear();
                    idx += 1;
                }
            }
        }
        out
    }

    #[test]
    fn the_seeds_worked_examples() {
        let o = ShardOptions::new(4);
        assert_eq!(
            all(10, o, 2),
            [
                vec![vec![0, 1, 2, 3], vec![8, 9, 0, 1]],
                vec![vec![4, 5, 6, 7], vec![2, 3, 4, 5]]
            ]
        );
        assert_eq!(
            all(6, o, 2),
            [vec![vec![0, 1, 2, 3]], vec![vec![4, 5, 0, 1]]]
        );
        let s = ShardedSampler::new(6, o, 2, 0).unwrap();
        assert_eq!(s.remainder(), Some(6));
        let gathered =
            metrics_from_gathered(&[vec![0, 1, 2, 3], vec![4, 5, 0, 1]], &s.gradient_state(0));
        assert_eq!(gathered, [0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn split_no_even_and_drop_last_by_hand() {
        // split: global batches [0..4) [4..8) [8, 9]; 2 items per rank.
        assert_eq!(
            all(10, opts(4, true, true, false), 2),
            [
                vec![vec![0, 1], vec![4, 5], vec![8, 9]],
                vec![vec![2, 3], vec![6, 7], vec![0, 1]]
            ]
        );
        assert_eq!(
            all(10, opts(4, true, false, false), 2),
            [
                vec![vec![0, 1], vec![4, 5], vec![8, 9]],
                vec![vec![2, 3], vec![6, 7]]
            ]
        );
        assert_eq!(
            all(10, opts(4, false, false, false), 2),
            [vec![vec![0, 1, 2, 3], vec![8, 9]], vec![vec![4, 5, 6, 7]]]
        );
        assert_eq!(
            all(10, opts(4, false, true, true), 2),
            [vec![vec![0, 1, 2, 3]], vec![vec![4, 5, 6, 7]]]
        );
        // Fewer items than one round: the epoch's start repeats.
        assert_eq!(
            all(3, ShardOptions::new(4), 2),
            [vec![vec![0, 1, 2, 0]], vec![vec![1, 2, 0, 1]]]
        );
        // One process: plain batches, the last one partial.
        assert_eq!(
            all(10, ShardOptions::new(4), 1),
            [vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]]
        );
    }

    #[test]
    fn closed_forms_match_a_port_of_accelerates_generators() {
        let mut cases = 0;
        for l in 0..=30 {
            for b in 1..=6 {
                for p in 1..=5 {
                    for flags in 0..8 {
                        let o = opts(b, flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
                        if o.validate(p, 0).is_err() {
                            assert!(ShardedSampler::new(l, o, p, 0).is_err());
                            continue;
                        }
                        let order: Vec<usize> = (0..l).collect();
                        for r in 0..p {
                            let s = ShardedSampler::new(l, o, p, r).unwrap();
                            let got: Vec<Vec<usize>> = s.iter().map(|x| x.indices).collect();
                            let want = reference(&order, o, p, r);
                            assert_eq!(got, want, "L={l} {o:?} P={p} rank {r}");
                            assert_eq!(s.len(), want.len(), "len: L={l} {o:?} P={p} rank {r}");
                            assert!(s.len() <= s.global_len());
                            cases += 1;
                        }
                    }
                }
            }
        }
        assert!(cases > 10_000, "{cases}");
    }

    #[test]
    fn every_item_is_seen_and_real_items_survive_gather_for_metrics() {
        for l in 0..=25 {
            for b in 1..=5 {
                for p in 1..=4 {
                    for flags in 0..4 {
                        let o = opts(
                            b * if flags & 1 != 0 { p } else { 1 },
                            flags & 1 != 0,
                            flags & 2 != 0,
                            false,
                        );
                        let samplers: Vec<ShardedSampler> = (0..p)
                            .map(|r| ShardedSampler::new(l, o, p, r).unwrap().with_shuffle(9))
                            .collect();
                        let mut seen = Vec::new();
                        for step in 0..samplers[0].global_len() {
                            let per_rank: Vec<Vec<usize>> = samplers
                                .iter()
                                .map(|s| s.batch(step).unwrap_or_default())
                                .collect();
                            seen.extend(metrics_from_gathered(
                                &per_rank,
                                &samplers[0].gradient_state(step),
                            ));
                        }
                        seen.sort_unstable();
                        assert_eq!(seen, (0..l).collect::<Vec<_>>(), "L={l} {o:?} P={p}");
                    }
                }
            }
        }
    }

    #[test]
    fn shuffling_agrees_across_ranks_and_changes_per_epoch() {
        let o = ShardOptions::new(3);
        let mut a = ShardedSampler::new(20, o, 2, 0).unwrap().with_shuffle(5);
        let mut b = ShardedSampler::new(20, o, 2, 1).unwrap().with_shuffle(5);
        assert_eq!(a.order(), b.order());
        assert_ne!(a.order(), (0..20).collect::<Vec<_>>());
        let epoch0 = a.order();
        // Given the permutation, the assignment is the unshuffled one mapped through it.
        let plain = ShardedSampler::new(20, o, 2, 1).unwrap();
        for step in 0..plain.len() {
            let mapped: Vec<usize> = plain
                .batch(step)
                .unwrap()
                .iter()
                .map(|&i| epoch0[i])
                .collect();
            assert_eq!(b.batch(step).unwrap(), mapped);
            assert_eq!(reference(&epoch0, o, 2, 1)[step], mapped);
        }
        a.set_epoch(1);
        b.set_epoch(1);
        assert_eq!(a.order(), b.order());
        assert_ne!(a.order(), epoch0);
        let mut sorted = a.order();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        // Seed 5 at epoch 1 is seed 6 at epoch 0 (Accelerate's `seed + epoch`).
        assert_eq!(
            a.order(),
            ShardedSampler::new(20, o, 2, 0)
                .unwrap()
                .with_shuffle(6)
                .order()
        );
        a.set_epoch(0);
        assert_eq!(a.order(), epoch0);
    }

    #[test]
    fn remainder_and_end_of_dataloader() {
        let s = ShardedSampler::new(10, ShardOptions::new(4), 2, 1).unwrap();
        assert_eq!(s.total_batch_size(), 8);
        assert_eq!(s.remainder(), Some(2));
        assert!(!s.gradient_state(0).end_of_dataloader());
        assert!(s.gradient_state(1).end_of_dataloader());
        let split = ShardedSampler::new(10, opts(4, true, true, false), 2, 0).unwrap();
        assert_eq!(split.total_batch_size(), 4);
        assert_eq!(split.remainder(), Some(2));
        let dropping = ShardedSampler::new(10, opts(4, false, true, true), 2, 0).unwrap();
        assert_eq!(dropping.remainder(), None);
        assert_eq!(GradientState::begin(None, 8, false).remainder(), None);
        // Remainder 0, or not at the end: everything is kept.
        let data = [vec![1, 2], vec![3, 4]];
        assert_eq!(
            metrics_from_gathered(&data, &GradientState::new(true, Some(0))),
            [1, 2, 3, 4]
        );
        assert_eq!(
            metrics_from_gathered(&data, &GradientState::new(false, Some(1))),
            [1, 2, 3, 4]
        );
        assert_eq!(
            metrics_from_gathered(&data, &GradientState::new(true, None)),
            [1, 2, 3, 4]
        );
        assert_eq!(
            metrics_from_gathered(&data, &GradientState::new(true, Some(3))),
            [1, 2, 3]
        );
        assert_eq!(
            metrics_from_gathered(&data, &GradientState::new(true, Some(9))),
            [1, 2, 3, 4]
        );
    }

    #[test]
    fn bad_options_are_refused() {
        assert!(ShardedSampler::new(10, ShardOptions::new(0), 2, 0).is_err());
        assert!(ShardedSampler::new(10, ShardOptions::new(4), 2, 2).is_err());
        assert!(ShardedSampler::new(10, ShardOptions::new(4), 0, 0).is_err());
        let e = ShardedSampler::new(10, opts(3, true, true, false), 2, 0).unwrap_err();
        assert!(
            e.to_string()
                .contains("multiple of the number of processes"),
            "{e}"
        );
        assert!(ShardedSampler::new(10, opts(3, true, true, false), 1, 0).is_ok());
        assert!(IterableShard::new(0..10, opts(1, true, true, false), 2, 0).is_err());
    }

    #[test]
    fn gather_for_metrics_through_a_single_process_communicator() {
        let accelerator = crate::Accelerator::from_env().unwrap();
        if accelerator.is_distributed() {
            return;
        }
        let comm = Communicator::with_backend(&accelerator, crate::comm::BackendKind::Cpu).unwrap();
        let s = ShardedSampler::new(10, ShardOptions::new(4), 1, 0).unwrap();
        let mut seen = Vec::new();
        for batch in &s {
            let items: Vec<i64> = batch.indices.iter().map(|&i| i as i64).collect();
            let gathered = gather_for_metrics(&comm, &items, &batch.state).unwrap();
            assert_eq!(gathered, items);
            seen.extend(gathered);
        }
        assert_eq!(seen, (0..10).collect::<Vec<i64>>());
        // The truncation applies to what the communicator returns.
        let last = GradientState::new(true, Some(1));
        assert_eq!(gather_for_metrics(&comm, &[7u8, 8, 9], &last).unwrap(), [7]);
        assert!(
            gather_for_metrics::<f32>(&comm, &[], &last)
                .unwrap()
                .is_empty()
        );
    }

    fn stream(l: usize, o: ShardOptions, p: usize) -> Vec<Vec<Vec<usize>>> {
        (0..p)
            .map(|r| IterableShard::new(0..l, o, p, r).unwrap().collect())
            .collect()
    }

    #[test]
    fn iterable_shards_by_hand() {
        assert_eq!(
            stream(10, ShardOptions::new(4), 2),
            [
                vec![vec![0, 1, 2, 3], vec![8, 9, 0, 1]],
                vec![vec![4, 5, 6, 7], vec![2, 3, 4, 5]]
            ]
        );
        assert_eq!(
            stream(8, opts(4, true, true, false), 2),
            [vec![vec![0, 1], vec![4, 5]], vec![vec![2, 3], vec![6, 7]]]
        );
        // A stream shorter than one buffer repeats itself.
        assert_eq!(
            stream(3, ShardOptions::new(2), 2),
            [vec![vec![0, 1]], vec![vec![2, 0]]]
        );
        assert_eq!(
            stream(10, opts(4, false, true, true), 2),
            [vec![vec![0, 1, 2, 3]], vec![vec![4, 5, 6, 7]]]
        );
        assert_eq!(
            stream(10, ShardOptions::new(4), 1),
            [vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]]
        );
        assert_eq!(
            stream(0, ShardOptions::new(4), 2),
            [Vec::<Vec<usize>>::new(), Vec::new()]
        );
    }

    #[test]
    fn iterable_shards_match_the_sampler_in_order_and_know_their_end() {
        // Accelerate's two paths agree on in-order data with even batches: both pad from the
        // first global batch (or the whole stream when shorter). Check that, and the
        // read-ahead end of the loader.
        for l in 0..=20 {
            for b in 1..=4 {
                for p in 1..=3 {
                    for flags in 0..4 {
                        let (split, drop) = (flags & 1 != 0, flags & 2 != 0);
                        let o = opts(if split { b * p } else { b }, split, true, drop);
                        for r in 0..p {
                            let mut shard =
                                IterableShard::new(0..l, o, p, r).unwrap().with_total_len(l);
                            let sampler = ShardedSampler::new(l, o, p, r).unwrap();
                            let mut step = 0;
                            while let Some(batch) = shard.next() {
                                let at = format!("L={l} {o:?} P={p} r={r} step {step}");
                                assert_eq!(Some(batch), sampler.batch(step), "{at}");
                                assert_eq!(
                                    shard.gradient_state(),
                                    sampler.gradient_state(step),
                                    "{at}"
                                );
                                step += 1;
                            }
                            assert_eq!(step, sampler.len(), "L={l} {o:?} P={p} r={r}");
                        }
                    }
                }
            }
        }
    }
}
