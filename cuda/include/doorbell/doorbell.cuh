// doorbell device API: what a kernel of yours needs to move data between GPUs. Include this one
// header (`#include <doorbell/doorbell.cuh>`, the folder above `doorbell/` on the include path:
// `doorbell.get_include()` in Python).
//
// It brings in three tiers, each a folder that includes only itself and the folders below it:
//   core/     memory-model leaves (atomics.cuh), bounded waits and the abort word (wait.cuh),
//             cooperative copies (copy.cuh), sums (reduce.cuh), LL packets (packet.cuh)
//   ib/       mlx5 work requests posted by the GPU (ibgda.cuh), which PortChannel uses when the
//             kernel posts its own RDMA
//   channel/  semaphores, MemoryChannel (NVLink loads and stores), the trigger FIFO and
//             PortChannel (DMA by the proxy, or RDMA the kernel posts)
// Two more are not included here, since a kernel that only puts, signals and waits has no use
// for them:
//   coll/     the collective call check and the low-latency MoE exchange as calls for your own
//             kernels (coll/moe_ll.cuh, coll/moe_net.cuh, their arguments in coll/moe_args.cuh):
//             include the one you use
//   detail/   launch arguments of doorbell's own kernels; nothing outside cuda/kernels needs them
// tests/header_tiers.rs holds the order core < ib < channel < coll < detail.
#pragma once

#include "core/atomics.cuh"
#include "core/common.cuh"
#include "core/copy.cuh"
#include "core/packet.cuh"
#include "core/reduce.cuh"
#include "core/wait.cuh"
#include "ib/ibgda.cuh"
#include "channel/fifo.cuh"
#include "channel/memory_channel.cuh"
#include "channel/port_channel.cuh"
#include "channel/semaphore.cuh"
