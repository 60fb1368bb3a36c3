//! Channels, above the transports: memory registered for peers to map ([`registered`]) and
//! buffers every rank holds alike with every peer's copy mapped ([`symmetric`]),
//! semaphores in each rank's token pool ([`semaphore`]),
//! MemoryChannels (kernels load and store into a peer's memory, [`memory_channel`]),
//! PortChannels (kernels push triggers that a proxy carries over a transport,
//! [`port_channel`]), and the proxy service ([`proxy`]: its tables, its thread) with the host
//! side of its device-to-host FIFO ([`fifo`]) and its thread's place ([`placement`]). The
//! communicator hands each channel set its state as a `wiring::Wiring` and the channel modules
//! build from it; their device handles are in [`crate::device_api`].

pub mod fifo;
pub mod memory_channel;
pub mod placement;
pub mod port_channel;
pub mod proxy;
pub mod registered;
pub mod semaphore;
pub mod symmetric;
pub mod wiring;
