//! The plan of MoE dispatch across nodes on the CPU (issue 16's CPU parts): DeepEP-style layouts
//! against brute force, the hierarchical high-throughput routing delivering every (token, rank)
//! exactly once while crossing the network at most once per (token, destination node), the
//! low-latency message counts, the high-throughput stream's receiver-driven admission (credits)
//! under incast and over several dispatches, the combine's partial rows in two halves, and the
//! wire model.

use doorbell::collectives::moe::plan::{
    forwards, ranks_of_tokens, ChunkStream, HighThroughputPlan, LowLatencyPlan, NodeMap, Posting,
    WireModel, HT_CHUNK,
};
use std::collections::BTreeMap;

/// A small deterministic generator (xorshift).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `tokens` x `topk` distinct experts per token, some entries -1, some tokens routed nowhere.
fn routing(rng: &mut Rng, tokens: usize, topk: usize, experts: usize) -> Vec<i32> {
    let mut idx = Vec::with_capacity(tokens * topk);
    for t in 0..tokens {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < topk {
            let e = rng.below(experts as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        if t % 7 == 3 {
            chosen.iter_mut().for_each(|e| *e = -1); // a token routed nowhere
        } else if rng.below(4) == 0 {
            chosen[rng.below(topk as u64) as usize] = -1;
        }
        idx.extend(chosen);
    }
    idx
}

#[test]
fn node_maps_group_ranks_and_refuse_uneven_nodes() {
    let m = NodeMap::new(&[7, 7, 9, 9, 7, 9]).unwrap();
    assert_eq!((m.nodes(), m.ranks_per_node(), m.world()), (2, 3, 6));
    assert_eq!((m.node(4), m.local(4)), (0, 2));
    assert_eq!(m.rank(1, 2), Some(5));
    assert_eq!(m.rank(2, 0), None);
    let e = NodeMap::new(&[1, 1, 2]).unwrap_err().to_string();
    assert!(e.contains("same number of ranks"), "{e}");
}

#[test]
fn high_throughput_plans_deliver_every_selection_once_and_cross_each_node_once() {
    for (nodes, per_node, topk, experts) in
        [(2, 1, 2, 8), (2, 2, 8, 64), (3, 2, 4, 24), (4, 4, 8, 256)]
    {
        let map = NodeMap::uniform(nodes, per_node);
        let world = map.world();
        let mut rng = Rng(0x9e37_79b9 ^ world as u64);
        let tokens = 64;
        let idx: Vec<Vec<i32>> = (0..world)
            .map(|_| routing(&mut rng, tokens, topk, experts))
            .collect();
        let per_rank = experts / world;
        let plans: Vec<HighThroughputPlan> = (0..world)
            .map(|r| HighThroughputPlan::new(&map, r, &idx[r], topk, experts).unwrap())
            .collect();
        let ranks_of: Vec<_> = idx
            .iter()
            .map(|i| ranks_of_tokens(i, topk, per_rank))
            .collect();
        for r in 0..world {
            // DeepEP's layout counts, against brute force.
            let mut per_node = vec![0u32; nodes];
            let mut per_rank_count = vec![0u32; world];
            for ranks in &ranks_of[r] {
                let mut ns: Vec<usize> = ranks.iter().map(|&d| map.node(d)).collect();
                ns.sort_unstable();
                ns.dedup();
                ns.iter().for_each(|&n| per_node[n] += 1);
                ranks.iter().for_each(|&d| per_rank_count[d] += 1);
                // At most once per destination node over the network.
                let crossings = ns.iter().filter(|&&n| n != map.node(r)).count();
                let naive = ranks
                    .iter()
                    .filter(|&&d| map.node(d) != map.node(r))
                    .count();
                assert!(crossings <= naive);
            }
            assert_eq!(plans[r].tokens_per_node, per_node, "rank {r}");
            assert_eq!(plans[r].tokens_per_rank, per_rank_count, "rank {r}");
            let selections: u32 = plans[r].tokens_per_expert.iter().sum();
            assert_eq!(
                selections as usize,
                idx[r].iter().filter(|&&e| e >= 0).count()
            );
            for (n, list) in plans[r].to_node.iter().enumerate() {
                let mut sorted = list.clone();
                sorted.dedup();
                assert_eq!(&sorted, list, "a token twice to node {n}");
                if n == map.node(r) {
                    assert!(list.is_empty());
                }
            }
        }
        // Every (source rank, token) reaches exactly the ranks that hold its experts: through
        // NVLink from its own node, or over the network once and then forwarded.
        let mut got: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (src, plan) in plans.iter().enumerate() {
            for (l, toks) in plan.to_local.iter().enumerate() {
                let dst = map.rank(map.node(src), l).unwrap();
                got.entry(dst)
                    .or_default()
                    .extend(toks.iter().map(|&t| (src, t)));
            }
        }
        for node in 0..nodes {
            for local in 0..per_node {
                for (l, pairs) in forwards(&map, node, local, &plans, &ranks_of)
                    .into_iter()
                    .enumerate()
                {
                    got.entry(map.rank(node, l).unwrap())
                        .or_default()
                        .extend(pairs);
                }
            }
        }
        for dst in 0..world {
            let mut want: Vec<(usize, usize)> = (0..world)
                .flat_map(|src| {
                    ranks_of[src]
                        .iter()
                        .enumerate()
                        .filter(move |(_, rs)| rs.contains(&dst))
                        .map(move |(t, _)| (src, t))
                })
                .collect();
            let mut have = got.remove(&dst).unwrap_or_default();
            want.sort_unstable();
            have.sort_unstable();
            assert_eq!(have, want, "rank {dst} ({nodes} nodes x {per_node})");
        }
    }
}

#[test]
fn low_latency_plans_count_messages_and_words() {
    let map = NodeMap::uniform(2, 4);
    let mut rng = Rng(42);
    let (topk, experts) = (8, 64);
    let idx = routing(&mut rng, 128, topk, experts);
    let plan = LowLatencyPlan::new(&map, 1, &idx, topk, experts).unwrap();
    let ranks = ranks_of_tokens(&idx, topk, experts / map.world());
    let remote: usize = ranks
        .iter()
        .map(|rs| rs.iter().filter(|&&r| r >= 4).count())
        .sum();
    let local: usize = ranks
        .iter()
        .map(|rs| rs.iter().filter(|&&r| r < 4).count())
        .sum();
    assert_eq!((plan.nvlink_messages, plan.rdma_messages), (local, remote));
    let counted: u32 = plan.counts.iter().flatten().sum();
    assert_eq!(counted as usize, idx.iter().filter(|&&e| e >= 0).count());
    assert_eq!(LowLatencyPlan::remote_ranks(&map, 1), 4);
    // One expert for every token: every message goes to one rank.
    let one: Vec<i32> = (0..16)
        .flat_map(|_| [9, -1, -1, -1, -1, -1, -1, -1])
        .collect();
    let p = LowLatencyPlan::new(&map, 0, &one, topk, experts).unwrap();
    assert_eq!((p.nvlink_messages, p.rdma_messages), (16, 0));
    assert_eq!(p.counts[1][1], 16);
}

/// Every sender's tokens for one receiver in a dispatch: some none, some more than a ring holds.
fn stream_tokens(rng: &mut Rng, senders: usize) -> Vec<Vec<u32>> {
    let mut all = Vec::with_capacity(senders);
    for _ in 0..senders {
        let n = if rng.below(5) == 0 { 0 } else { rng.below(300) };
        let mut tokens = Vec::new();
        for t in 0..n as u32 {
            if rng.below(3) != 0 {
                tokens.push(t);
            }
        }
        all.push(tokens);
    }
    all
}

#[test]
fn the_chunk_stream_never_overruns_a_small_ring_under_incast() {
    for seed in 1..60u64 {
        let mut rng = Rng(seed * 0x2545_f491);
        let senders = 1 + rng.below(32) as usize;
        let chunks = 1 + rng.below(4) as usize;
        let mut stream = ChunkStream::new(senders, chunks).unwrap();
        let mut sent_chunks = vec![0u64; senders];
        for epoch in 1..=4u64 {
            let tokens = stream_tokens(&mut rng, senders);
            for (s, t) in tokens.iter().enumerate() {
                let n = stream.begin(s, epoch, t).unwrap();
                assert_eq!(n, t.len().div_ceil(HT_CHUNK).max(1), "at least one chunk");
                sent_chunks[s] += n as u64;
            }
            let mut got = vec![Vec::new(); senders];
            let mut done = vec![false; senders];
            let mut steps = 0u64;
            // Senders and the receiver's per-source loops in any interleaving, as blocks of
            // several GPUs run them.
            while done.iter().any(|d| !d) {
                steps += 1;
                assert!(steps < 10_000_000, "no progress (seed {seed})");
                let s = rng.below(senders as u64) as usize;
                if rng.below(2) == 0 {
                    stream.send(s).unwrap();
                } else if !done[s] {
                    if let Some(c) = stream.receive(s, epoch).unwrap() {
                        assert!(c.tokens.len() <= HT_CHUNK);
                        got[s].extend(c.tokens);
                        done[s] = c.last;
                    }
                }
                assert!(
                    stream.in_use() <= senders * chunks,
                    "more slots held than exist"
                );
            }
            for s in 0..senders {
                assert_eq!(
                    got[s], tokens[s],
                    "seed {seed}, dispatch {epoch}: sender {s} in order"
                );
                assert_eq!(stream.positions(s), (sent_chunks[s], sent_chunks[s]));
            }
        }
    }
}

#[test]
fn a_sender_waits_for_credits_and_the_receiver_refuses_other_dispatches() {
    // A ring of one chunk: the second chunk waits until the first is consumed.
    let mut stream = ChunkStream::new(1, 1).unwrap();
    let tokens: Vec<u32> = (0..40).collect();
    assert_eq!(stream.begin(0, 1, &tokens).unwrap(), 2);
    assert!(
        stream.begin(0, 2, &tokens).is_err(),
        "a dispatch before the last one was sent"
    );
    assert!(stream.send(0).unwrap());
    assert!(!stream.send(0).unwrap(), "no credit yet: the ring is full");
    assert_eq!(stream.in_use(), 1);
    let first = stream.receive(0, 1).unwrap().unwrap();
    assert_eq!((first.tokens.len(), first.last), (HT_CHUNK, false));
    assert!(stream.receive(0, 1).unwrap().is_none(), "nothing signalled");
    assert!(stream.send(0).unwrap(), "the credit freed the slot");
    let second = stream.receive(0, 1).unwrap().unwrap();
    assert_eq!(
        (second.tokens, second.last),
        ((32..40).collect::<Vec<u32>>(), true)
    );
    // An empty dispatch still sends one (empty, last) chunk; a receiver in another dispatch
    // refuses it.
    stream.begin(0, 2, &[]).unwrap();
    assert!(stream.send(0).unwrap());
    assert!(stream.receive(0, 3).is_err());
    // A ring of no chunks is refused.
    assert!(ChunkStream::new(1, 0).is_err());
}

#[test]
fn the_wire_model_counts_wqes_and_bytes() {
    // DeepEP's decode shape on 2 nodes of 8: 128 tokens x top-8 of 256 experts, FP8 messages of
    // 7168 bytes + 56 x 4 scale bytes + an 80-byte header.
    let map = NodeMap::uniform(2, 8);
    let mut rng = Rng(7);
    let idx = routing(&mut rng, 128, 8, 256);
    let plan = LowLatencyPlan::new(&map, 0, &idx, 8, 256).unwrap();
    let peers = LowLatencyPlan::remote_ranks(&map, 0);
    let msg = 80 + 7168 + 56 * 4;
    let gpu = WireModel::low_latency(&plan, peers, msg, Posting::Gpu);
    assert_eq!(gpu.wqes as usize, plan.rdma_messages + 3 * peers);
    assert_eq!(
        gpu.bytes,
        plan.rdma_messages as u64 * msg + 24 * peers as u64
    );
    assert_eq!(gpu.triggers, 0);
    let proxy = WireModel::low_latency(&plan, peers, msg, Posting::Proxy);
    assert_eq!(proxy.triggers as usize, plan.rdma_messages + 2 * peers);
    let us = gpu.wire_us(400.0, 0.9, 2.0);
    assert!(us > 2.0 && us < 1000.0, "{us}");
    let ht = HighThroughputPlan::new(&map, 0, &idx, 8, 256).unwrap();
    let m = WireModel::high_throughput(&ht, msg, Posting::Gpu);
    let chunks = ht.to_node[1].len().div_ceil(HT_CHUNK).max(1) as u64;
    assert_eq!(m.wqes, ht.network_rows() as u64 + 5 * chunks);
    assert_eq!(m.bytes, ht.network_rows() as u64 * msg + 48 * chunks);
}

/// The model table of `docs/performance.md` ("MoE across nodes: the wire model"): DeepEP's
/// decode and prefill shapes, per node count, what one rank puts on the network and how long a
/// 400 Gb/s NIC takes for it (90% of line rate for payload, 2 us of latency). Printed with
/// `cargo test --test moe_plan -- --nocapture wire_model_table`.
#[test]
fn wire_model_table() {
    let msg_fp8 = 80 + 7168 + 56 * 4; // header (top-8 ids and weights), e4m3 row, f32 scale per 128
    println!(
        "| shape | nodes x ranks | RDMA rows/rank | WQEs/rank (GPU) | WQEs/token | MB/rank | wire us at 400 Gb/s |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for nodes in [2usize, 4, 8] {
        let map = NodeMap::uniform(nodes, 8);
        let experts = 256; // DeepSeek-V3: 256 routed experts
        let mut rng = Rng(11 + nodes as u64);
        let idx = routing(&mut rng, 128, 8, experts);
        let ll = LowLatencyPlan::new(&map, 0, &idx, 8, experts).unwrap();
        let peers = LowLatencyPlan::remote_ranks(&map, 0);
        let m = WireModel::low_latency(&ll, peers, msg_fp8, Posting::Gpu);
        println!(
            "| LL dispatch, 128 tokens, top-8, FP8 | {nodes} x 8 | {} | {} | {:.2} | {:.2} | {:.1} |",
            ll.rdma_messages,
            m.wqes,
            m.wqes as f64 / 128.0,
            m.bytes as f64 / 1e6,
            m.wire_us(400.0, 0.9, 2.0)
        );
        let mut rng = Rng(23 + nodes as u64);
        let idx = routing(&mut rng, 4096, 8, experts);
        let ht = HighThroughputPlan::new(&map, 0, &idx, 8, experts).unwrap();
        let m = WireModel::high_throughput(&ht, msg_fp8, Posting::Gpu);
        println!(
            "| HT dispatch, 4096 tokens, top-8, FP8 | {nodes} x 8 | {} | {} | {:.2} | {:.2} | {:.1} |",
            ht.network_rows(),
            m.wqes,
            m.wqes as f64 / 4096.0,
            m.bytes as f64 / 1e6,
            m.wire_us(400.0, 0.9, 2.0)
        );
        assert!(ht.network_rows() <= 4096 * (nodes - 1));
    }
}

/// The node-spanning high-throughput combine's partial rows, as `moe_ht_combine_send` and
/// `_recv` use them, with `halves` buffers by the call's parity: each rank sends call n's rows
/// into every peer's area (half n % halves), then, once every peer's signal for n is in, reads
/// its own area one source at a time while the peers run on. Returns the first read that found
/// another call's row, over random interleavings of `ranks` ranks making `calls` combines.
fn combine_overwrite(ranks: usize, calls: u64, halves: u64, seed: u64) -> Option<String> {
    // part[dst][half][src]: the call whose row src last wrote there.
    let mut part = vec![vec![vec![0u64; ranks]; halves as usize]; ranks];
    let mut sent = vec![0u64; ranks];
    // Each rank: Some(next source to read) while receiving call `call[r]`, None before its send.
    let mut call = vec![1u64; ranks];
    let mut reading: Vec<Option<usize>> = vec![None; ranks];
    let mut rng = Rng(seed);
    while call.iter().any(|&c| c <= calls) {
        let r = rng.below(ranks as u64) as usize;
        let n = call[r];
        if n > calls {
            continue;
        }
        match reading[r] {
            None => {
                for area in part.iter_mut() {
                    area[(n % halves) as usize][r] = n;
                }
                sent[r] = n;
                reading[r] = Some(0);
            }
            // The receive waits for every peer's signal of this call.
            Some(_) if sent.iter().any(|&s| s < n) => {}
            Some(src) => {
                let got = part[r][(n % halves) as usize][src];
                if got != n {
                    return Some(format!(
                        "rank {r} summing call {n} read call {got}'s row from rank {src}"
                    ));
                }
                if src + 1 == ranks {
                    reading[r] = None;
                    call[r] = n + 1;
                } else {
                    reading[r] = Some(src + 1);
                }
            }
        }
    }
    None
}

#[test]
fn back_to_back_combines_need_two_halves_of_partial_rows() {
    // One buffer: a peer done with call n sends call n + 1's rows into a rank still summing n
    // (the race two back-to-back combines hit on 4 separate nodes, fixed in 23ac262).
    let raced = (0..200).find_map(|seed| combine_overwrite(4, 6, 1, seed + 1));
    assert!(raced.is_some(), "one half: some interleaving overwrites");
    // Two halves by parity: a peer can be one call ahead, never two (call n + 2 needs this
    // rank's rows of n + 1, sent after it summed n).
    for ranks in 2..=5 {
        for seed in 0..300 {
            assert_eq!(
                combine_overwrite(ranks, 8, 2, seed + 1),
                None,
                "{ranks} ranks, seed {seed}"
            );
        }
    }
}
