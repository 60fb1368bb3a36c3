// doorbell device API: everything a kernel needs. Include this one header.
#pragma once

#include "atomics.cuh"
#include "call_check.cuh"
#include "collective_args.cuh"
#include "copy.cuh"
#include "fifo.cuh"
#include "ibgda.cuh"
#include "limits.cuh"
#include "memory_channel.cuh"
#include "moe.cuh"
#include "moe_net.cuh"
#include "packet.cuh"
#include "port_channel.cuh"
#include "semaphore.cuh"
#include "wait.cuh"
