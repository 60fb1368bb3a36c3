//! Channels, above the transports: semaphores in each rank's token pool ([`semaphore`]),
//! MemoryChannels (kernels load and store into a peer's memory, [`memory_channel`]),
//! PortChannels (kernels push triggers that a proxy carries over a transport,
//! [`port_channel`]), and the proxy service with its device-to-host FIFO ([`proxy`]). The
//! communicator builds them; their device handles are in [`crate::device_api`].

pub mod memory_channel;
pub mod port_channel;
pub mod proxy;
pub mod semaphore;
