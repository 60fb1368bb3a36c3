//! Posting RDMA work: connected queue pairs between ranks ([`conn`]), the mlx5 work requests and
//! completions as the NIC reads and writes them ([`wqe`], [`cq`]), the host posters and the proxy's
//! connection ([`host_qp`], [`poster`]), queue pairs kernels post to ([`gpu_qp`]), and which way
//! work gets posted ([`select`]).

pub mod conn;
pub mod cq;
pub mod gpu_qp;
pub mod host_qp;
pub mod poster;
pub mod select;
pub mod wqe;
