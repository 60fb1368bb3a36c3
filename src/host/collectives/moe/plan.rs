//! MoE dispatch and combine across nodes: the plan, on the CPU. What the node-spanning kernels
//! (`cuda/kernels/moe_net.cu`, driven by `MoeHighThroughput` and `MoeLowLatency` when a
//! communicator spans nodes) do, in a form tests can check exhaustively without a GPU:
//!
//! - [`NodeMap`]: which node each rank is on and its index there (every node holds the same
//!   number of ranks, as DeepEP's internode mode requires).
//! - [`HighThroughputPlan`]: DeepEP's hierarchical high-throughput routing. A token crosses the
//!   network once per destination node, to the rank of the same local index there, which
//!   forwards it over NVLink to the ranks of its node that hold any of its experts; the combine
//!   reduces inside the node first and sends one partial row per (token, node) back.
//! - [`LowLatencyPlan`]: DeepEP's internode low-latency routing. Each selected (token, rank) pair
//!   is one message straight to that rank, over NVLink where the rank shares the node and over
//!   RDMA otherwise; one count word per destination rank follows the data.
//! - [`ChunkStream`]: receiver-driven admission of the high-throughput network stream, exactly as
//!   the kernels count it: per source a ring of a few chunk slots at the receiver, a credit per
//!   chunk consumed, positions monotonic over dispatches. The model holds both sides' counters
//!   and the ring, so any interleaving of senders and receiver can be checked for overruns.
//! - [`WireModel`]: what the kernels put on the wire (WQEs and bytes per rank for each posting
//!   mode) and the time that takes on a NIC of a given rate.

use crate::error::{Error, Result};

/// Which node each rank is on, and its index inside the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMap {
    node_of: Vec<usize>,
    local_of: Vec<usize>,
    ranks_per_node: usize,
}

impl NodeMap {
    /// From each rank's node id (the communicator's `node_ids`; any values, equal for ranks of
    /// one node). Nodes are numbered by first appearance; every node must hold as many ranks.
    pub fn new(node_ids: &[u64]) -> Result<NodeMap> {
        let mut ids: Vec<u64> = Vec::new();
        let mut node_of = Vec::with_capacity(node_ids.len());
        let mut local_of = Vec::with_capacity(node_ids.len());
        let mut sizes: Vec<usize> = Vec::new();
        for id in node_ids {
            let n = match ids.iter().position(|x| x == id) {
                Some(n) => n,
                None => {
                    ids.push(*id);
                    sizes.push(0);
                    ids.len() - 1
                }
            };
            node_of.push(n);
            local_of.push(sizes[n]);
            sizes[n] += 1;
        }
        let ranks_per_node = sizes.first().copied().unwrap_or(0);
        if let Some((n, s)) = sizes
            .iter()
            .enumerate()
            .find(|(_, s)| **s != ranks_per_node)
        {
            return Err(Error::invalid(
                "nodes",
                format!(
                    "node {n} holds {s} ranks, node 0 holds {ranks_per_node}: MoE across nodes \
                     needs the same number of ranks on every node"
                ),
            ));
        }
        Ok(NodeMap {
            node_of,
            local_of,
            ranks_per_node,
        })
    }

    /// Nodes of `nodes` x `per_node` consecutive ranks.
    pub fn uniform(nodes: usize, per_node: usize) -> NodeMap {
        let ids: Vec<u64> = (0..nodes * per_node)
            .map(|r| (r / per_node) as u64)
            .collect();
        NodeMap::new(&ids).expect("uniform nodes")
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> usize {
        self.node_of
            .len()
            .checked_div(self.ranks_per_node)
            .unwrap_or(0)
    }

    /// Ranks on each node.
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// The node of `rank`.
    pub fn node(&self, rank: usize) -> usize {
        self.node_of[rank]
    }

    /// The index of `rank` inside its node.
    pub fn local(&self, rank: usize) -> usize {
        self.local_of[rank]
    }

    /// The rank with local index `local` on `node` (none past the last node or local index).
    pub fn rank(&self, node: usize, local: usize) -> Option<usize> {
        (0..self.world()).find(|&r| self.node_of[r] == node && self.local_of[r] == local)
    }
}

/// For each token of `topk_idx` (`[T, topk]`, -1: no expert), the ranks holding any of its
/// experts, ascending, each once.
pub fn ranks_of_tokens(topk_idx: &[i32], topk: usize, experts_per_rank: usize) -> Vec<Vec<usize>> {
    topk_idx
        .chunks(topk)
        .map(|ids| {
            let mut ranks: Vec<usize> = ids
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| e as usize / experts_per_rank)
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            ranks
        })
        .collect()
}

/// One rank's high-throughput dispatch across nodes, hierarchical as DeepEP's internode mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HighThroughputPlan {
    /// Tokens this rank sends to each node over the network (its own node: none), in token order:
    /// they land on the rank of this rank's local index there.
    pub to_node: Vec<Vec<usize>>,
    /// Tokens this rank sends over NVLink to each rank of its own node (itself included: the rows
    /// it keeps), in token order.
    pub to_local: Vec<Vec<usize>>,
    /// DeepEP's `num_tokens_per_rank`: tokens that reach each rank, whatever the path.
    pub tokens_per_rank: Vec<u32>,
    /// DeepEP's `num_tokens_per_rdma_rank`: tokens that reach each node.
    pub tokens_per_node: Vec<u32>,
    /// DeepEP's `num_tokens_per_expert`: selections of each expert.
    pub tokens_per_expert: Vec<u32>,
    /// This rank's node.
    pub home: usize,
}

impl HighThroughputPlan {
    /// The plan of rank `me` for `topk_idx` (`[T, topk]`) with `num_experts` spread evenly over
    /// the ranks of `map`.
    pub fn new(
        map: &NodeMap,
        me: usize,
        topk_idx: &[i32],
        topk: usize,
        num_experts: usize,
    ) -> Result<HighThroughputPlan> {
        let world = map.world();
        if world == 0 || num_experts % world != 0 || topk == 0 || topk_idx.len() % topk != 0 {
            return Err(Error::invalid(
                "MoE plan",
                format!(
                    "{num_experts} experts over {world} ranks, top-{topk}, {} indices",
                    topk_idx.len()
                ),
            ));
        }
        if let Some(&e) = topk_idx
            .iter()
            .find(|&&e| e < -1 || e >= num_experts as i32)
        {
            return Err(Error::invalid(
                "topk_idx",
                format!("expert {e} outside -1..{num_experts}"),
            ));
        }
        let per_rank = num_experts / world;
        let mut plan = HighThroughputPlan {
            to_node: vec![Vec::new(); map.nodes()],
            to_local: vec![Vec::new(); map.ranks_per_node()],
            tokens_per_rank: vec![0; world],
            tokens_per_node: vec![0; map.nodes()],
            tokens_per_expert: vec![0; num_experts],
            home: map.node(me),
        };
        for &e in topk_idx.iter().filter(|&&e| e >= 0) {
            plan.tokens_per_expert[e as usize] += 1;
        }
        let home = plan.home;
        for (t, ranks) in ranks_of_tokens(topk_idx, topk, per_rank).iter().enumerate() {
            let mut nodes: Vec<usize> = ranks.iter().map(|&r| map.node(r)).collect();
            nodes.sort_unstable();
            nodes.dedup();
            for &r in ranks {
                plan.tokens_per_rank[r] += 1;
                if map.node(r) == home {
                    plan.to_local[map.local(r)].push(t);
                }
            }
            for n in nodes {
                plan.tokens_per_node[n] += 1;
                if n != home {
                    plan.to_node[n].push(t);
                }
            }
        }
        Ok(plan)
    }

    /// Rows this rank puts on the network (each at most once per destination node).
    pub fn network_rows(&self) -> usize {
        self.to_node.iter().map(Vec::len).sum()
    }
}

/// What the rank of local index `local` on `node` forwards over NVLink, having received from
/// every node's rank of the same local index: for each rank of its node, (source rank, token)
/// pairs in source-rank then token order. `plans[r]` is rank `r`'s [`HighThroughputPlan`];
/// `ranks_of[r]` rank `r`'s [`ranks_of_tokens`].
pub fn forwards(
    map: &NodeMap,
    node: usize,
    local: usize,
    plans: &[HighThroughputPlan],
    ranks_of: &[Vec<Vec<usize>>],
) -> Vec<Vec<(usize, usize)>> {
    let mut out = vec![Vec::new(); map.ranks_per_node()];
    for src_node in (0..map.nodes()).filter(|&n| n != node) {
        let Some(src) = map.rank(src_node, local) else {
            continue;
        };
        for &t in &plans[src].to_node[node] {
            for &r in &ranks_of[src][t] {
                if map.node(r) == node {
                    out[map.local(r)].push((src, t));
                }
            }
        }
    }
    out
}

/// One rank's low-latency dispatch across nodes: one message per selected (token, rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowLatencyPlan {
    /// Messages to ranks of this rank's node (NVLink stores).
    pub nvlink_messages: usize,
    /// Messages to ranks of other nodes (RDMA WRITEs).
    pub rdma_messages: usize,
    /// Per destination rank and local expert, the selections of this rank's tokens (DeepEP's
    /// `num_tokens_per_expert`, which the receiver counts from the messages' headers).
    pub counts: Vec<Vec<u32>>,
}

impl LowLatencyPlan {
    /// The plan of rank `me` for `topk_idx` (`[T, topk]`).
    pub fn new(
        map: &NodeMap,
        me: usize,
        topk_idx: &[i32],
        topk: usize,
        num_experts: usize,
    ) -> Result<LowLatencyPlan> {
        let world = map.world();
        if world == 0 || num_experts % world != 0 || topk == 0 || topk_idx.len() % topk != 0 {
            return Err(Error::invalid(
                "MoE plan",
                format!("{num_experts} experts over {world} ranks, top-{topk}"),
            ));
        }
        let per_rank = num_experts / world;
        let mut plan = LowLatencyPlan {
            nvlink_messages: 0,
            rdma_messages: 0,
            counts: vec![vec![0; per_rank]; world],
        };
        for (t, ranks) in ranks_of_tokens(topk_idx, topk, per_rank).iter().enumerate() {
            for &r in ranks {
                if map.node(r) == map.node(me) {
                    plan.nvlink_messages += 1;
                } else {
                    plan.rdma_messages += 1;
                }
            }
            for &e in topk_idx[t * topk..(t + 1) * topk]
                .iter()
                .filter(|&&e| e >= 0)
            {
                let e = e as usize;
                plan.counts[e / per_rank][e % per_rank] += 1;
            }
        }
        Ok(plan)
    }

    /// Ranks on other nodes: each gets one count word from this rank per dispatch (with its
    /// flush and signal), whether or not a message went there.
    pub fn remote_ranks(map: &NodeMap, me: usize) -> usize {
        (0..map.world())
            .filter(|&r| map.node(r) != map.node(me))
            .count()
    }
}

/// Messages per chunk of the high-throughput network stream (`kHtChunk` in
/// `detail/collective_args.cuh`: one warp posts a chunk).
pub const HT_CHUNK: usize = crate::device_api::limits::HT_CHUNK;

/// A chunk's descriptor as the receiver reads it from its ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The dispatch it belongs to.
    pub epoch: u64,
    /// Its tokens, in the sender's order (at most [`HT_CHUNK`]).
    pub tokens: Vec<u32>,
    /// The sender's last chunk of this dispatch.
    pub last: bool,
}

/// One sender's side of the stream and the receiver's counters for it, named as in the kernels.
#[derive(Debug, Clone, Default)]
struct Link {
    /// Chunks of the current dispatch still to send.
    pending: std::collections::VecDeque<Chunk>,
    /// `sent_chunks`: chunks sent over all dispatches.
    sent: u64,
    /// Credits the sender has taken (its credit channel's `expected_inbound`).
    credits_taken: u64,
    /// Credits the receiver has signalled (the sender's credit inbound token).
    credits_given: u64,
    /// Data signals sent (the receiver's inbound token) and consumed by the receiver.
    signals: u64,
    signals_taken: u64,
    /// `recv_chunks`: chunks received over all dispatches.
    received: u64,
    /// The receiver's ring for this sender: slot -> the chunk written there and not yet consumed.
    ring: Vec<Option<Chunk>>,
}

/// Receiver-driven admission of the high-throughput stream from several senders into one
/// receiver, step by step as `moe_ht_exchange` runs it. Each sender owns a ring of `chunks` slots
/// at the receiver; a dispatch sends at least one chunk (an empty last one when no token goes
/// there); a sender writes chunk `g >= chunks` only after taking a credit, and the receiver gives
/// one after consuming each chunk. [`ChunkStream::send`] is an error if a write would land on a
/// slot the receiver has not consumed: the property the credits exist for.
#[derive(Debug, Clone)]
pub struct ChunkStream {
    chunks: usize,
    links: Vec<Link>,
}

impl ChunkStream {
    /// `senders` senders, each with a ring of `chunks` chunk slots at the receiver.
    pub fn new(senders: usize, chunks: usize) -> Result<ChunkStream> {
        if chunks == 0 {
            return Err(Error::invalid("chunk stream", "a ring of 0 chunks"));
        }
        let link = Link {
            ring: vec![None; chunks],
            ..Link::default()
        };
        Ok(ChunkStream {
            chunks,
            links: vec![link; senders],
        })
    }

    /// Sender `s` starts dispatch `epoch` with `tokens` for this receiver (in its order): its
    /// chunks of up to [`HT_CHUNK`], at least one. An error if its previous dispatch is unsent.
    pub fn begin(&mut self, s: usize, epoch: u64, tokens: &[u32]) -> Result<usize> {
        let link = &mut self.links[s];
        if !link.pending.is_empty() {
            return Err(Error::invalid(
                "chunk stream",
                format!("sender {s} began dispatch {epoch} before sending the last one"),
            ));
        }
        let n = tokens.len().div_ceil(HT_CHUNK).max(1);
        for i in 0..n {
            let part =
                &tokens[(i * HT_CHUNK).min(tokens.len())..((i + 1) * HT_CHUNK).min(tokens.len())];
            link.pending.push_back(Chunk {
                epoch,
                tokens: part.to_vec(),
                last: i + 1 == n,
            });
        }
        Ok(n)
    }

    /// Sender `s` tries to write its next chunk: `Ok(false)` when it has none or waits for a
    /// credit, `Ok(true)` when written (data, descriptor, signal), an error when the write would
    /// overrun a slot the receiver still holds.
    pub fn send(&mut self, s: usize) -> Result<bool> {
        let chunks = self.chunks as u64;
        let link = &mut self.links[s];
        if link.pending.is_empty() {
            return Ok(false);
        }
        if link.sent >= chunks {
            // Chunk g >= chunks waits for the credit of chunk g - chunks.
            if link.credits_given <= link.credits_taken {
                return Ok(false);
            }
            link.credits_taken += 1;
        }
        let slot = (link.sent % chunks) as usize;
        if let Some(held) = &link.ring[slot] {
            return Err(Error::invalid(
                "chunk stream",
                format!(
                    "sender {s} overran slot {slot}: chunk {} of dispatch {} is not consumed",
                    link.received, held.epoch
                ),
            ));
        }
        link.ring[slot] = link.pending.pop_front();
        link.sent += 1;
        link.signals += 1;
        Ok(true)
    }

    /// The receiver takes sender `s`'s next chunk of dispatch `epoch` if its signal arrived
    /// (`Ok(None)` otherwise), frees its slot and signals a credit. An error if the slot holds
    /// nothing or another dispatch's chunk.
    pub fn receive(&mut self, s: usize, epoch: u64) -> Result<Option<Chunk>> {
        let chunks = self.chunks as u64;
        let link = &mut self.links[s];
        if link.signals <= link.signals_taken {
            return Ok(None);
        }
        link.signals_taken += 1;
        let slot = (link.received % chunks) as usize;
        let chunk = link.ring[slot].take().ok_or_else(|| {
            Error::invalid(
                "chunk stream",
                format!("sender {s}: slot {slot} signalled empty"),
            )
        })?;
        if chunk.epoch != epoch {
            return Err(Error::invalid(
                "chunk stream",
                format!(
                    "sender {s}: dispatch {} arrived during {epoch}",
                    chunk.epoch
                ),
            ));
        }
        link.received += 1;
        link.credits_given += 1;
        Ok(Some(chunk))
    }

    /// Chunk slots the receiver holds written and unconsumed, over all senders (at most
    /// `senders x chunks`).
    pub fn in_use(&self) -> usize {
        self.links
            .iter()
            .map(|l| l.ring.iter().filter(|c| c.is_some()).count())
            .sum()
    }

    /// Chunks sender `s` has sent and the receiver has taken, over all dispatches.
    pub fn positions(&self, s: usize) -> (u64, u64) {
        (self.links[s].sent, self.links[s].received)
    }
}

/// How work requests reach the NIC, for [`WireModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posting {
    /// Kernels write WQEs and ring (IBGDA), or a host thread rings (CPU-assisted): same WQEs.
    Gpu,
    /// The proxy turns PortChannel triggers into work requests (mlx5 WQEs or `ibv_post_send`).
    Proxy,
}

/// What the kernels put on the wire for a plan, and how long that takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireModel {
    /// Work requests this rank posts.
    pub wqes: u64,
    /// Bytes this rank puts on the wire (payload: WRITE data, READ and atomic operands).
    pub bytes: u64,
    /// FIFO triggers the GPU pushes (proxy posting; 0 when the GPU posts).
    pub triggers: u64,
}

impl WireModel {
    /// A low-latency dispatch as `moe_net::finish_send` posts it: one WRITE per RDMA message of
    /// `msg_bytes` (header, row, FP8 scales), and to every rank on another node (`remote_ranks`,
    /// even with no message for it) the count word's WRITE, a READ (the flush) and the fetch-add
    /// the receiver waits for; with the proxy, one trigger per put and one per signal.
    pub fn low_latency(
        plan: &LowLatencyPlan,
        remote_ranks: usize,
        msg_bytes: u64,
        posting: Posting,
    ) -> WireModel {
        let rows = plan.rdma_messages as u64;
        let peers = remote_ranks as u64;
        WireModel {
            wqes: rows + 3 * peers,
            bytes: rows * msg_bytes + peers * 24,
            triggers: match posting {
                Posting::Gpu => 0,
                Posting::Proxy => rows + 2 * peers,
            },
        }
    }

    /// A high-throughput dispatch as `moe_ht_exchange` posts it: per other node, the tokens that
    /// go there in chunks of [`HT_CHUNK`] (at least one chunk), each chunk its WRITEs, a 16-byte
    /// descriptor WRITE, a READ and a fetch-add; and the credits this rank returns as a receiver
    /// for as many chunks (a READ and a fetch-add each).
    pub fn high_throughput(
        plan: &HighThroughputPlan,
        msg_bytes: u64,
        posting: Posting,
    ) -> WireModel {
        let chunks: u64 = plan
            .to_node
            .iter()
            .enumerate()
            .filter(|&(n, _)| n != plan.home)
            .map(|(_, t)| (t.len().div_ceil(HT_CHUNK).max(1)) as u64)
            .sum();
        let rows = plan.network_rows() as u64;
        // Credits: the same number of chunks arrive here in a balanced exchange.
        WireModel {
            wqes: rows + 3 * chunks + 2 * chunks,
            bytes: rows * msg_bytes + chunks * 32 + chunks * 16,
            triggers: match posting {
                Posting::Gpu => 0,
                Posting::Proxy => rows + 2 * chunks + chunks,
            },
        }
    }

    /// Microseconds the bytes take on a NIC of `gbit_per_s` at `efficiency` of line rate (the
    /// payload share after headers and protocol), plus `latency_us` once.
    pub fn wire_us(&self, gbit_per_s: f64, efficiency: f64, latency_us: f64) -> f64 {
        latency_us + self.bytes as f64 * 8.0 / (gbit_per_s * 1e3 * efficiency)
    }
}
