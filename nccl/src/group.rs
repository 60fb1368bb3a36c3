//! `ncclGroupStart`/`ncclGroupEnd`: per thread, calls made inside a group are held and run at
//! the outermost end. Initializations held in one group run side by side (one thread may
//! initialize several ranks of one communicator, as nccl-tests does with `-g`/`-t`: run one
//! after another they would wait for each other forever).

use crate::comm::Comm;
use crate::error::ShimError;
use crate::p2p::P2pOp;
use std::cell::RefCell;
use std::sync::Arc;

type Held = Box<dyn FnOnce() -> Result<(), ShimError> + Send>;

#[derive(Default)]
struct Group {
    depth: usize,
    /// For each open level, whether the real NCCL's group was started with it.
    real_levels: Vec<bool>,
    inits: Vec<Held>,
    /// Sends and receives, by communicator, in call order.
    p2p: Vec<(Arc<Comm>, P2pOp)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// `ncclGroupStart`.
pub fn start() {
    start_with(false);
}

/// `ncclGroupStart`, `real`: the real NCCL's group was started too.
pub fn start_with(real: bool) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        g.depth += 1;
        g.real_levels.push(real);
    });
}

/// Whether this thread is inside a group.
pub fn inside() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// Holds an initialization until the group ends (only inside a group).
pub fn hold_init(f: Held) {
    GROUP.with(|g| g.borrow_mut().inits.push(f));
}

/// Holds a send or receive until the group ends (only inside a group).
pub fn hold_p2p(comm: Arc<Comm>, op: P2pOp) {
    GROUP.with(|g| g.borrow_mut().p2p.push((comm, op)));
}

/// `ncclGroupEnd`: at the outermost end, runs the held initializations side by side, then each
/// communicator's sends and receives (one doorbell all-to-all(v), or, where doorbell does not run
/// the pattern, the real NCCL's sends and receives, inside its group); returns the first failure
/// (every one runs to its end; without a group: invalid usage) and whether the real NCCL's group
/// was started at this level (the caller ends it).
pub fn end() -> (Result<(), ShimError>, bool) {
    let ended = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(ShimError::new(
                crate::abi::INVALID_USAGE,
                "ncclGroupEnd without ncclGroupStart",
            ));
        }
        g.depth -= 1;
        let real = g.real_levels.pop().unwrap_or(false);
        Ok(if g.depth == 0 {
            (
                std::mem::take(&mut g.inits),
                std::mem::take(&mut g.p2p),
                real,
            )
        } else {
            (Vec::new(), Vec::new(), real)
        })
    });
    match ended {
        Ok((inits, p2p, real)) => (run_held(inits, p2p), real),
        Err(e) => (Err(e), false),
    }
}

fn run_held(inits: Vec<Held>, p2p: Vec<(Arc<Comm>, P2pOp)>) -> Result<(), ShimError> {
    let inited = run_inits(inits);
    // Then each communicator's sends and receives, as one all-to-all(v) each.
    let mut first = inited;
    let mut left = p2p;
    while let Some((comm, _)) = left.first().cloned() {
        let (mine, rest): (Vec<_>, Vec<_>) =
            left.into_iter().partition(|(c, _)| Arc::ptr_eq(c, &comm));
        left = rest;
        let ops: Vec<P2pOp> = mine.into_iter().map(|(_, o)| o).collect();
        let r = match crate::colls::grouped_plan(&comm, &ops) {
            Ok(planned) => {
                crate::real::count(true);
                crate::colls::grouped_p2p_planned(&comm, planned)
            }
            // Not doorbell's: the real NCCL's, as bytes (a send or receive moves them whatever
            // their type), else why not.
            Err(why) => match comm.real("ncclSend/ncclRecv") {
                Ok(rc) => ops.iter().try_for_each(|o| {
                    crate::forwarded_p2p(rc, o, o.bytes, crate::abi::dtype::UINT8)
                }),
                Err(_) => Err(why),
            },
        };
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// Runs held initializations side by side; the first failure.
fn run_inits(inits: Vec<Held>) -> Result<(), ShimError> {
    match inits.len() {
        0 => Ok(()),
        1 => inits.into_iter().next().expect("one")(),
        _ => std::thread::scope(|s| {
            let runs: Vec<_> = inits.into_iter().map(|f| s.spawn(f)).collect();
            let mut first = Ok(());
            for r in runs {
                let r = r.join().unwrap_or_else(|_| {
                    Err(ShimError::new(
                        crate::abi::INTERNAL_ERROR,
                        "an initialization panicked",
                    ))
                });
                if first.is_ok() {
                    first = r;
                }
            }
            first
        }),
    }
}
