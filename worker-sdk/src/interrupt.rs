//! A thread's interrupt check for the SDK's blocking calls: what lets the Python SDK's main
//! thread make a call itself, with no helper thread, and still answer Ctrl-C.
//!
//! [`with_check`] installs a check on the calling thread for the length of a closure. Each call
//! that closure makes to the coordinator through the SDK's runtime (key-value, shared values,
//! NCCL unique ids, quorum, a barrier without a relay) then calls the check every
//! [`INTERRUPT_CHECK`] while it waits, and ends with [`Error::Interrupted`] when the check says
//! true. The interrupted call's request is dropped: a write may or may not have been applied,
//! as with any call cut short (a lane write gives up its sequence number,
//! [`crate::client::KvLane`]). A barrier through the agent's relay, which this thread reads
//! itself, asks the same check between reads ([`crate::relay::RelayConn::barrier`]), every
//! [`INTERRUPT_CHECK`] too.

use crate::Error;
use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

/// How often a wait calls its interrupt check.
pub const INTERRUPT_CHECK: Duration = Duration::from_millis(50);

/// A thread's check: whether to stop waiting.
pub type Check = Box<dyn FnMut() -> bool>;

thread_local! {
    static CHECK: RefCell<Option<Check>> = const { RefCell::new(None) };
}

/// Runs `f` with `check` installed on this thread (the check before it is put back after,
/// also when `f` panics).
pub fn with_check<T>(check: Check, f: impl FnOnce() -> T) -> T {
    /// Puts the previous check back.
    struct Restore(Option<Check>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CHECK.with(|c| *c.borrow_mut() = previous);
        }
    }
    let _restore = Restore(CHECK.with(|c| c.borrow_mut().replace(check)));
    f()
}

/// Whether this thread has a check.
pub(crate) fn installed() -> bool {
    CHECK.with(|c| c.borrow().is_some())
}

/// Calls this thread's check (false without one). It is out of its slot meanwhile, so that a
/// call it makes (a Python signal handler using the SDK) waits without one rather than
/// re-entering it.
pub(crate) fn interrupted() -> bool {
    let Some(mut check) = CHECK.with(|c| c.borrow_mut().take()) else {
        return false;
    };
    let stop = check();
    CHECK.with(|c| {
        let mut slot = c.borrow_mut();
        if slot.is_none() {
            *slot = Some(check);
        }
    });
    stop
}

/// Runs `call` to its end on `runtime`, this thread driving it; with a check installed, asks
/// it every [`INTERRUPT_CHECK`] and gives `call` up with [`Error::Interrupted`] (naming
/// `what()`, made only then) when it says true.
pub(crate) fn block_on<T>(
    runtime: &tokio::runtime::Runtime,
    what: impl FnOnce() -> String,
    call: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    if !installed() {
        return runtime.block_on(call);
    }
    let mut call = std::pin::pin!(call);
    loop {
        // The check runs between slices, outside the runtime: what it calls (a Python signal
        // handler) may block on a runtime itself.
        let slice =
            runtime.block_on(async { tokio::time::timeout(INTERRUPT_CHECK, &mut call).await });
        if let Ok(answer) = slice {
            return answer;
        }
        if interrupted() {
            return Err(Error::Interrupted { what: what() });
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Instant;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_check_ends_a_wait_and_only_while_installed() {
        let rt = runtime();
        let pending = || std::future::pending::<Result<(), Error>>();
        // Asked every INTERRUPT_CHECK: the third time stops the wait.
        let mut asked = 0;
        let started = Instant::now();
        let got = with_check(
            Box::new(move || {
                asked += 1;
                asked == 3
            }),
            || block_on(&rt, || "key 'k'".to_owned(), pending()),
        );
        let took = started.elapsed();
        match got {
            Err(Error::Interrupted { what }) => assert_eq!(what, "key 'k'"),
            other => panic!("{other:?}"),
        }
        assert!(took >= INTERRUPT_CHECK * 3, "{took:?}");
        assert!(
            took < INTERRUPT_CHECK * 3 + Duration::from_secs(1),
            "{took:?}"
        );
        // Gone after with_check: a call without one runs to its end.
        assert!(!installed());
        let answer = block_on(&rt, || "a value".to_owned(), async {
            tokio::time::sleep(INTERRUPT_CHECK * 2).await;
            Ok(7)
        });
        assert_eq!(answer.unwrap(), 7);
        // A call that ends first never asks.
        let got = with_check(Box::new(|| panic!("not asked")), || {
            block_on(&rt, || "a value".to_owned(), async { Ok(8) })
        });
        assert_eq!(got.unwrap(), 8);
    }

    #[test]
    fn a_call_made_by_the_check_itself_waits_without_it_and_the_check_stays() {
        let rt = runtime();
        let rt2 = runtime();
        let mut calls = 0;
        let got = with_check(
            Box::new(move || {
                calls += 1;
                // What a signal handler using the SDK does: a call of its own, unchecked.
                assert!(!installed());
                let inner = block_on(&rt2, || "inner".to_owned(), async {
                    tokio::task::yield_now().await;
                    Ok(1)
                });
                assert_eq!(inner.unwrap(), 1);
                calls == 2
            }),
            || {
                let first = block_on(
                    &rt,
                    || "first".to_owned(),
                    std::future::pending::<Result<(), Error>>(),
                );
                // The check is still there for the next call.
                assert!(installed());
                first
            },
        );
        assert!(matches!(got, Err(Error::Interrupted { .. })), "{got:?}");
    }
}
