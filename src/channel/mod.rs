//! Channels, above the transports: semaphores in each rank's token pool ([`semaphore`]),
//! MemoryChannels (kernels load and store into a peer's memory, [`memory_channel`]),
//! PortChannels (kernels push triggers that a proxy carries over a transport,
//! [`port_channel`]), and the proxy service ([`proxy`]: its tables, its thread) with the host
//! side of its device-to-host FIFO ([`fifo`]) and its thread's place ([`placement`]). The
//! communicator builds them; their device handles are in [`crate::device_api`].

pub mod fifo;
pub mod memory_channel;
pub mod placement;
pub mod port_channel;
pub mod proxy;
pub mod semaphore;
