//! The job's shape, computed once from every rank's node id and asked everywhere: which ranks
//! share this rank's node (the NVLink team, reached by CUDA IPC), whether the job spans nodes,
//! the nodes in order, each rank's index in its node, and this rank's rail peers (the ranks of its
//! own index on the other nodes, which DeepEP's hierarchical routing sends to).

/// Which node each rank is on. Node ids are opaque (equal ids share a node: a physical host, or
/// an emulated node with `DOORBELL_SEPARATE_NODES`); nodes are numbered by their first rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    rank: usize,
    node_ids: Vec<u64>,
    /// The ranks of each node, ascending; nodes in order of their first rank.
    nodes: Vec<Vec<usize>>,
    /// Each rank's node and its index there.
    node_of: Vec<usize>,
    local_of: Vec<usize>,
}

impl Topology {
    /// The shape of a job whose rank `r` is on node `node_ids[r]`, seen from `rank`.
    pub fn new(rank: usize, node_ids: Vec<u64>) -> Topology {
        let mut nodes: Vec<Vec<usize>> = Vec::new();
        let mut node_of = Vec::with_capacity(node_ids.len());
        let mut local_of = Vec::with_capacity(node_ids.len());
        for (r, id) in node_ids.iter().enumerate() {
            let n = match nodes.iter().position(|n| node_ids[n[0]] == *id) {
                Some(n) => n,
                None => {
                    nodes.push(Vec::new());
                    nodes.len() - 1
                }
            };
            node_of.push(n);
            local_of.push(nodes[n].len());
            nodes[n].push(r);
        }
        Topology {
            rank,
            node_ids,
            nodes,
            node_of,
            local_of,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.node_ids.len()
    }
    /// Every rank's node id.
    pub fn node_ids(&self) -> &[u64] {
        &self.node_ids
    }
    /// True if `peer` is on this rank's node (its memory maps here by CUDA IPC).
    pub fn same_node(&self, peer: usize) -> bool {
        self.node_ids.get(peer).is_some() && self.node_ids.get(peer) == self.node_ids.get(self.rank)
    }
    /// True if some rank is on another node: the collectives then take their node-spanning paths.
    pub fn spans_nodes(&self) -> bool {
        self.nodes.len() > 1
    }
    /// The ranks of each node, ascending, nodes in order of their first rank.
    pub fn nodes(&self) -> &[Vec<usize>] {
        &self.nodes
    }
    /// The ranks of this rank's node (itself included): its NVLink team.
    pub fn team(&self) -> &[usize] {
        self.nodes
            .get(self.node_of.get(self.rank).copied().unwrap_or(0))
            .map_or(&[], Vec::as_slice)
    }
    /// The node of `rank` (numbered by first rank).
    pub fn node(&self, rank: usize) -> usize {
        self.node_of[rank]
    }
    /// The index of `rank` inside its node.
    pub fn local(&self, rank: usize) -> usize {
        self.local_of[rank]
    }
    /// Ranks per node when every node holds as many, else `None`.
    pub fn ranks_per_node(&self) -> Option<usize> {
        let n = self.nodes.first()?.len();
        self.nodes.iter().all(|x| x.len() == n).then_some(n)
    }
    /// This rank's rail peers: on every other node, the rank with this rank's index there (nodes
    /// with fewer ranks have none), in node order.
    pub fn rail_peers(&self) -> Vec<usize> {
        let (mine, local) = (self.node(self.rank), self.local(self.rank));
        self.nodes
            .iter()
            .enumerate()
            .filter(|(n, _)| *n != mine)
            .filter_map(|(_, ranks)| ranks.get(local).copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_spans_nodes_when_any_rank_has_another_node() {
        assert!(!Topology::new(1, vec![7, 7, 7]).spans_nodes());
        assert!(Topology::new(0, vec![7, 7, 9]).spans_nodes());
        assert!(Topology::new(2, vec![7, 7, 9]).spans_nodes());
        assert!(!Topology::new(0, vec![5]).spans_nodes());
    }

    #[test]
    fn nodes_teams_and_rail_peers_follow_the_node_ids() {
        // Ranks 0, 2, 4 on node 7; 1, 3, 5 on node 9 (interleaved, as a launcher may place them).
        let t = Topology::new(3, vec![7, 9, 7, 9, 7, 9]);
        assert_eq!(t.nodes(), &[vec![0, 2, 4], vec![1, 3, 5]]);
        assert_eq!(t.team(), &[1, 3, 5]);
        assert_eq!((t.node(3), t.local(3)), (1, 1));
        assert!(t.same_node(5) && !t.same_node(2) && !t.same_node(6));
        assert_eq!(t.rail_peers(), vec![2]);
        assert_eq!(t.ranks_per_node(), Some(3));
        // Uneven nodes: no rail peer where the other node is too small.
        let u = Topology::new(2, vec![1, 1, 1, 2, 2]);
        assert_eq!(u.ranks_per_node(), None);
        assert_eq!(u.rail_peers(), Vec::<usize>::new());
        assert_eq!(Topology::new(4, vec![1, 1, 1, 2, 2]).rail_peers(), vec![1]);
    }
}
