//! `ncclSend`/`ncclRecv` inside a group. What doorbell runs itself is the pattern PyTorch's
//! `all_to_all_single` (and alltoallv in general) makes: in one group of one communicator, at
//! most one send to and one receive from each rank (itself included; ranks with nothing to move
//! left out, as PyTorch leaves zero counts out), each send a slice of one input region and each
//! receive a slice of one output region, on one stream. That becomes one doorbell
//! all-to-all(v) (`AllToAll::run_v_raw`), whose kernel checks on the device that what each rank
//! sends matches what its peer expects. Other patterns go to the real NCCL (`crate::group`).

use std::fmt;

/// One `ncclSend` (`send`) or `ncclRecv` of a group, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pOp {
    pub send: bool,
    pub peer: usize,
    pub ptr: u64,
    pub bytes: usize,
    pub stream: u64,
}

impl fmt::Display for P2pOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.send { "send to" } else { "receive from" };
        write!(f, "{kind} rank {} of {} bytes", self.peer, self.bytes)
    }
}

/// A group's sends and receives as one all-to-all(v): the regions (base address and bytes) and
/// doorbell's count array (`4 x world` byte values: send counts, send offsets, receive counts,
/// receive offsets, by rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllToAllV {
    pub input: u64,
    pub input_bytes: usize,
    pub output: u64,
    pub output_bytes: usize,
    pub counts: Vec<u64>,
    pub stream: u64,
}

/// One side's region: base, extent and each rank's (bytes, offset).
fn region(ops: &[&P2pOp], world: usize) -> (u64, usize, Vec<(u64, u64)>) {
    let mut per = vec![(0u64, 0u64); world];
    let live: Vec<&&P2pOp> = ops.iter().filter(|o| o.bytes > 0).collect();
    let Some(base) = live.iter().map(|o| o.ptr).min() else {
        return (0, 0, per);
    };
    let end = live
        .iter()
        .map(|o| o.ptr + o.bytes as u64)
        .max()
        .unwrap_or(base);
    for o in live {
        per[o.peer] = (o.bytes as u64, o.ptr - base);
    }
    (base, (end - base) as usize, per)
}

/// The group's sends and receives of rank `me` of `world` as one all-to-all(v), or why they are
/// not one.
pub fn plan(ops: &[P2pOp], world: usize, me: usize) -> Result<AllToAllV, String> {
    let Some(first) = ops.first() else {
        return Err("no send or receive".into());
    };
    if let Some(o) = ops.iter().find(|o| o.stream != first.stream) {
        return Err(format!(
            "the group's operations use more than one stream ({o} is on another)"
        ));
    }
    if let Some(o) = ops.iter().find(|o| o.peer >= world) {
        return Err(format!("{o}: no such rank among {world}"));
    }
    let mut seen = vec![[false; 2]; world];
    for o in ops {
        let s = &mut seen[o.peer][usize::from(o.send)];
        if std::mem::replace(s, true) {
            return Err(format!(
                "more than one {}",
                if o.send {
                    format!("send to rank {}", o.peer)
                } else {
                    format!("receive from rank {}", o.peer)
                }
            ));
        }
    }
    let sends: Vec<&P2pOp> = ops.iter().filter(|o| o.send).collect();
    let recvs: Vec<&P2pOp> = ops.iter().filter(|o| !o.send).collect();
    let (input, input_bytes, s) = region(&sends, world);
    let (output, output_bytes, r) = region(&recvs, world);
    if s[me].0 != r[me].0 {
        return Err(format!(
            "rank {me} sends itself {} bytes but receives {} from itself",
            s[me].0, r[me].0
        ));
    }
    if input_bytes > 0
        && output_bytes > 0
        && input < output + output_bytes as u64
        && output < input + input_bytes as u64
    {
        return Err("the sends' region overlaps the receives' region".into());
    }
    let mut counts = Vec::with_capacity(4 * world);
    counts.extend(s.iter().map(|x| x.0));
    counts.extend(s.iter().map(|x| x.1));
    counts.extend(r.iter().map(|x| x.0));
    counts.extend(r.iter().map(|x| x.1));
    Ok(AllToAllV {
        input,
        input_bytes,
        output,
        output_bytes,
        counts,
        stream: first.stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(send: bool, peer: usize, ptr: u64, bytes: usize) -> P2pOp {
        P2pOp {
            send,
            peer,
            ptr,
            bytes,
            stream: 7,
        }
    }

    #[test]
    fn torchs_all_to_all_single_becomes_one_all_to_all_v() {
        // Rank 1 of 3: sends 100 / 0 (left out) / 300 bytes from one input, receives 10 / 0 /
        // 30 into one output, in PyTorch's order (send r, recv r for each r).
        let ops = [
            op(true, 0, 1000, 100),
            op(false, 0, 5000, 10),
            op(true, 2, 1100, 300),
            op(false, 2, 5010, 30),
        ];
        let p = plan(&ops, 3, 1).unwrap();
        assert_eq!(
            (p.input, p.input_bytes, p.output, p.output_bytes, p.stream),
            (1000, 400, 5000, 40, 7)
        );
        assert_eq!(p.counts, vec![100, 0, 300, 0, 0, 100, 10, 0, 30, 0, 0, 10]);
        // Its own block: sent and received at the same size.
        let ops = [op(true, 0, 1000, 8), op(false, 0, 5000, 8)];
        assert_eq!(plan(&ops, 1, 0).unwrap().counts, vec![8, 0, 8, 0]);
    }

    #[test]
    fn other_patterns_are_named() {
        let e = |ops: &[P2pOp], world, me| plan(ops, world, me).unwrap_err();
        assert!(e(&[], 2, 0).contains("no send"));
        assert!(e(&[op(true, 1, 0, 4), op(true, 1, 8, 4)], 2, 0)
            .contains("more than one send to rank 1"));
        assert!(e(&[op(false, 3, 0, 4)], 2, 0).contains("no such rank"));
        let mut other = op(false, 1, 100, 4);
        other.stream = 9;
        assert!(e(&[op(true, 1, 0, 4), other], 2, 0).contains("more than one stream"));
        assert!(
            e(&[op(true, 0, 0, 4), op(false, 0, 100, 8)], 2, 0).contains("sends itself 4 bytes")
        );
        assert!(e(&[op(true, 1, 0, 64), op(false, 1, 32, 64)], 2, 0).contains("overlaps"));
    }
}
