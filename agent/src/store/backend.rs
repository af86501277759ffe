//! Each TCPStore operation as calls of the SDK's [`Kv`] client on the job's key-value store at
//! the coordinator: the key mapping shared with the Python SDK's `muster.torch.Store`, atomic
//! operations on the coordinator's `Add` and `CompareAndSet`, blocking waits on its waiting
//! `Get`, and the queues, which torch keeps apart from the keys.
//!
//! Failover: every call is retried on the next leader when its outcome is unknown. Reads and
//! an add of 0 are safe to apply twice; every mutation (a set, a delete, an add, a
//! compare-and-set, each compare-and-set of an append or a queue pop, a push's claim of its
//! index and its item) goes through the connection's [`KvLane`], whose calls the coordinator
//! applies at most once, so a retry of one that was applied gets its first answer instead of
//! applying again over another client's write in between. A popped item's delete is plain:
//! nobody writes that key again.

use std::time::Duration;

use muster::{
    Error,
    client::{Kv, KvLane},
};

/// How long one waiting `Get` at the coordinator lasts before the agent asks again. torch's
/// client does not send its timeout (it cancels with `CANCEL_WAIT`), so a wait is a series of
/// these until its keys are set or the client cancels.
const WAIT_CHUNK: Duration = Duration::from_secs(30);

/// The job's store as a TCPStore: keys under `torch/g<generation>/`, the prefix and encodings
/// of the Python SDK's `muster.torch.Store` (values are the bytes set; a counter is its
/// decimal text, as the coordinator's `Add` and torch's own store write it), so the two are
/// two doors into the same keys.
#[derive(Debug, Clone)]
pub(crate) struct Backend {
    kv: Kv,
    /// `torch/g<generation>/`: the keys.
    keys: String,
    /// `torch/q<generation>/`: the queues, outside the keys so that `num_keys` and
    /// `list_keys` do not count them (torch keeps queues apart too).
    queues: String,
}

impl Backend {
    /// A lane for one connection's mutations (its requests are sequential, as a lane's
    /// calls must be).
    pub fn lane(&self) -> KvLane {
        self.kv.lane()
    }

    /// The store of `generation` in the job that `kv` is bound to.
    pub fn new(kv: Kv, generation: u64) -> Self {
        Self {
            kv,
            keys: format!("torch/g{generation}/"),
            queues: format!("torch/q{generation}/"),
        }
    }

    /// The coordinator's key for a key on the wire. torch's client puts `/` before every key
    /// (its `keyPrefix_`), which `muster.torch.Store` does not see; one leading `/` is dropped
    /// so that `store.set("k")` through either door is the same key.
    fn full(&self, key: &str) -> String {
        format!("{}{}", self.keys, key.strip_prefix('/').unwrap_or(key))
    }

    fn queue(&self, name: &str, part: &str) -> String {
        format!(
            "{}{}/{part}",
            self.queues,
            name.strip_prefix('/').unwrap_or(name)
        )
    }

    pub async fn set(&self, lane: &mut KvLane, key: &str, value: Vec<u8>) -> Result<(), Error> {
        lane.set(&self.full(key), value).await
    }

    /// The value, or empty when the key is unset (torch's server answers a missing key so;
    /// its client waits for the key before it gets).
    pub async fn get(&self, key: &str) -> Result<Vec<u8>, Error> {
        Ok(self.kv.get(&self.full(key)).await?.unwrap_or_default())
    }

    /// An add of 0 (torch's read of a counter, polled by its store-based barrier) is a plain
    /// call, which is retried as a read and leaves the lane's record alone; any other goes
    /// through the lane.
    pub async fn add(&self, lane: &mut KvLane, key: &str, delta: i64) -> Result<i64, Error> {
        if delta == 0 {
            return self.kv.add(&self.full(key), 0).await;
        }
        lane.add(&self.full(key), delta).await
    }

    /// torch's semantics: an empty `expected` means "only if the key is unset"; the answer is
    /// the value after the call, or `expected` when the key is unset and stays unset.
    pub async fn compare_set(
        &self,
        lane: &mut KvLane,
        key: &str,
        expected: Vec<u8>,
        desired: Vec<u8>,
    ) -> Result<Vec<u8>, Error> {
        let want = (!expected.is_empty()).then_some(expected.as_slice());
        let outcome = lane.compare_and_set(&self.full(key), want, desired).await?;
        Ok(outcome.current.unwrap_or(expected))
    }

    /// Whether every key is set, or is a queue with an item in it (as torch's server says).
    pub async fn check(&self, keys: &[String]) -> Result<bool, Error> {
        for key in keys {
            if self.kv.get(&self.full(key)).await?.is_none() && self.queue_len(key).await? == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Returns once every key is set (or is a non-empty queue). Cancel-safe: dropping it
    /// leaves nothing behind at the coordinator but a waiting `Get` that ends on its own.
    pub async fn wait(&self, keys: &[String]) -> Result<(), Error> {
        for key in keys {
            self.wait_one(key).await?;
        }
        Ok(())
    }

    async fn wait_one(&self, key: &str) -> Result<(), Error> {
        let full = self.full(key);
        loop {
            if self.kv.get(&full).await?.is_some() {
                return Ok(());
            }
            let (head, tail) = self.queue_ends(key).await?;
            if tail > head {
                return Ok(());
            }
            // Whichever comes first: the key, or the next item pushed on a queue of that name.
            let next = self.queue(key, &format!("item/{tail}"));
            let woke = tokio::select! {
                r = self.kv.get_wait(&full, WAIT_CHUNK) => r,
                r = self.kv.get_wait(&next, WAIT_CHUNK) => r,
            };
            match woke {
                Ok(_) => return Ok(()),
                Err(e) if e.is_timeout() => continue,
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn num_keys(&self) -> Result<i64, Error> {
        Ok(self.kv.list(&self.keys).await?.len() as i64)
    }

    /// Whether the key existed.
    pub async fn delete(&self, lane: &mut KvLane, key: &str) -> Result<bool, Error> {
        lane.delete(&self.full(key)).await
    }

    /// Appends with a compare-and-set loop at the coordinator, so concurrent appends from
    /// several ranks are never lost; each attempt is a call of the lane, so one whose swap
    /// was applied before a failover is not appended again.
    pub async fn append(&self, lane: &mut KvLane, key: &str, value: &[u8]) -> Result<(), Error> {
        let full = self.full(key);
        loop {
            let current = self.kv.get(&full).await?;
            let mut next = current.clone().unwrap_or_default();
            next.extend_from_slice(value);
            if lane
                .compare_and_set(&full, current.as_deref(), next)
                .await?
                .swapped
            {
                return Ok(());
            }
        }
    }

    /// The keys, as torch's client wrote them (with its leading `/`).
    pub async fn list_keys(&self) -> Result<Vec<String>, Error> {
        Ok(self
            .kv
            .list(&self.keys)
            .await?
            .into_iter()
            .filter_map(|(k, _)| k.strip_prefix(&self.keys).map(|k| format!("/{k}")))
            .collect())
    }

    /// A counter of a queue (absent: 0) and the bytes it holds, for a compare-and-set.
    async fn counter(&self, key: &str) -> Result<(i64, Option<Vec<u8>>), Error> {
        let raw = self.kv.get(key).await?;
        let n = raw
            .as_deref()
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok((n, raw))
    }

    /// A queue's head (the next index to pop) and tail (the next index to push).
    async fn queue_ends(&self, name: &str) -> Result<(i64, i64), Error> {
        let (head, _) = self.counter(&self.queue(name, "head")).await?;
        let (tail, _) = self.counter(&self.queue(name, "tail")).await?;
        Ok((head, tail))
    }

    /// Pushes: the tail counter is claimed atomically (`Add`, on the lane: claimed once across
    /// a failover), then the item is written (on the lane too: a retry never writes it again
    /// after a pop took it).
    pub async fn queue_push(
        &self,
        lane: &mut KvLane,
        name: &str,
        value: Vec<u8>,
    ) -> Result<(), Error> {
        let index = lane.add(&self.queue(name, "tail"), 1).await? - 1;
        lane.set(&self.queue(name, &format!("item/{index}")), value)
            .await
    }

    pub async fn queue_len(&self, name: &str) -> Result<i64, Error> {
        let (head, tail) = self.queue_ends(name).await?;
        Ok((tail - head).max(0))
    }

    /// Pops the oldest item, or `None` when the queue is empty: torch's server does not
    /// block a pop (its client blocks with a `WAIT` on the queue's name first). An item is
    /// claimed by moving the head with a compare-and-set, once the tail shows it exists, so
    /// two ranks never pop the same item; the compare-and-set is on the lane, so a claim
    /// applied before a failover is not taken again (which would skip an item).
    pub async fn queue_pop(&self, lane: &mut KvLane, name: &str) -> Result<Option<Vec<u8>>, Error> {
        let head_key = self.queue(name, "head");
        loop {
            let (head, raw) = self.counter(&head_key).await?;
            let (tail, _) = self.counter(&self.queue(name, "tail")).await?;
            if tail <= head {
                return Ok(None);
            }
            let claimed = lane
                .compare_and_set(&head_key, raw.as_deref(), (head + 1).to_string())
                .await?
                .swapped;
            if !claimed {
                continue;
            }
            let item = self.queue(name, &format!("item/{head}"));
            // The pusher claims its index before it writes the item: wait out that gap.
            let value = loop {
                match self.kv.get_wait(&item, WAIT_CHUNK).await {
                    Ok(v) => break v,
                    Err(e) if e.is_timeout() => continue,
                    Err(e) => return Err(e),
                }
            };
            self.kv.delete(&item).await?;
            return Ok(Some(value));
        }
    }
}
