// Prints the size and field offsets of every device handle that has a Rust mirror. build.rs
// compiles this with the host C++ compiler (which also proves the headers are includable from
// host-only code), runs it, and turns the output into a table the layout test compares against
// Rust's offset_of!. Format: "struct <Name> <size> <align>" then "field <Name> <field> <offset> <size>";
// then "const <name> <value>" for the constants and enum codes Rust keeps twins of (coll/limits.cuh
// and the codes the host decodes). It includes every tier, detail/ too.
#include <doorbell/coll/call_check.cuh>
#include <doorbell/coll/limits.cuh>
#include <doorbell/coll/moe_args.cuh>
#include <doorbell/detail/collective_args.cuh>
#include <doorbell/doorbell.cuh>

#include <cstdio>

#define STRUCT(T) std::printf("struct %s %zu %zu\n", #T, sizeof(doorbell::T), alignof(doorbell::T))
#define FIELD(T, f) \
  std::printf("field %s %s %zu %zu\n", #T, #f, offsetof(doorbell::T, f), sizeof(doorbell::T{}.f))
// A constant or enum code shared with Rust: "const <name> <value>".
#define CONST(name) std::printf("const %s %llu\n", #name, static_cast<unsigned long long>(doorbell::name))

int main() {
  STRUCT(WaitReport);
  FIELD(WaitReport, valid);
  FIELD(WaitReport, what);
  FIELD(WaitReport, rank);
  FIELD(WaitReport, peer);
  FIELD(WaitReport, channel);
  FIELD(WaitReport, block);
  FIELD(WaitReport, thread);
  FIELD(WaitReport, reserved);
  FIELD(WaitReport, expected);
  FIELD(WaitReport, seen);
  FIELD(WaitReport, waited_ns);
  FIELD(WaitReport, abort);
  FIELD(WaitReport, mismatch_peer);
  FIELD(WaitReport, mismatch_mine);
  FIELD(WaitReport, mismatch_theirs);
  FIELD(WaitReport, mismatch_valid);
  FIELD(WaitReport, mismatch_counts);
  FIELD(WaitReport, mismatch_mine_send);
  FIELD(WaitReport, mismatch_mine_recv);
  FIELD(WaitReport, mismatch_theirs_send);
  FIELD(WaitReport, mismatch_theirs_recv);
  FIELD(WaitReport, dead_peers);

  STRUCT(WaitSite);
  FIELD(WaitSite, report);
  FIELD(WaitSite, claim);
  FIELD(WaitSite, budget_ns);
  FIELD(WaitSite, rank);
  FIELD(WaitSite, peer);
  FIELD(WaitSite, channel);
  FIELD(WaitSite, reserved);

  STRUCT(SemaphoreHandle);
  FIELD(SemaphoreHandle, inbound_token);
  FIELD(SemaphoreHandle, expected_inbound);
  FIELD(SemaphoreHandle, remote_inbound_token);
  FIELD(SemaphoreHandle, site);

  STRUCT(MemoryChannelHandle);
  FIELD(MemoryChannelHandle, semaphore);
  FIELD(MemoryChannelHandle, dst);
  FIELD(MemoryChannelHandle, src);
  FIELD(MemoryChannelHandle, packet_buffer);
  FIELD(MemoryChannelHandle, remote_packet_buffer);
  FIELD(MemoryChannelHandle, dst_bytes);
  FIELD(MemoryChannelHandle, src_bytes);
  FIELD(MemoryChannelHandle, packet_buffer_bytes);

  STRUCT(ProxyTrigger);
  FIELD(ProxyTrigger, src_offset);
  FIELD(ProxyTrigger, dst_offset);
  FIELD(ProxyTrigger, size);
  FIELD(ProxyTrigger, meta);

  STRUCT(IbQpHandle);
  FIELD(IbQpHandle, sq);
  FIELD(IbQpHandle, dbr);
  FIELD(IbQpHandle, doorbell);
  FIELD(IbQpHandle, cq);
  FIELD(IbQpHandle, cq_ci);
  FIELD(IbQpHandle, state);
  FIELD(IbQpHandle, sizes);
  FIELD(IbQpHandle, host_ready);
  FIELD(IbQpHandle, qpn);
  FIELD(IbQpHandle, sq_log2);
  FIELD(IbQpHandle, cq_log2);
  FIELD(IbQpHandle, flags);
  FIELD(IbQpHandle, site);

  STRUCT(FifoHandle);
  FIELD(FifoHandle, triggers);
  FIELD(FifoHandle, head);
  FIELD(FifoHandle, tail);
  FIELD(FifoHandle, tail_cache);
  FIELD(FifoHandle, stopped);
  FIELD(FifoHandle, size_log2);
  FIELD(FifoHandle, reserved);
  FIELD(FifoHandle, site);

  STRUCT(PortChannelHandle);
  FIELD(PortChannelHandle, fifo);
  FIELD(PortChannelHandle, inbound_token);
  FIELD(PortChannelHandle, expected_inbound);
  FIELD(PortChannelHandle, flush_done);
  FIELD(PortChannelHandle, semaphore);
  FIELD(PortChannelHandle, dst_mem);
  FIELD(PortChannelHandle, src_mem);
  FIELD(PortChannelHandle, reserved);
  FIELD(PortChannelHandle, ib);

  STRUCT(IbPortLink);
  FIELD(IbPortLink, qp);
  FIELD(IbPortLink, src);
  FIELD(IbPortLink, dst);
  FIELD(IbPortLink, token);
  FIELD(IbPortLink, scratch);
  FIELD(IbPortLink, src_key);
  FIELD(IbPortLink, dst_key);
  FIELD(IbPortLink, token_key);
  FIELD(IbPortLink, scratch_key);
  FIELD(IbPortLink, stripes);
  FIELD(IbPortLink, reserved);
  FIELD(IbPortLink, more);

  STRUCT(AllReduceArgs);
  FIELD(AllReduceArgs, input);
  FIELD(AllReduceArgs, output);
  FIELD(AllReduceArgs, count);
  FIELD(AllReduceArgs, scratch);
  FIELD(AllReduceArgs, rs_sems);
  FIELD(AllReduceArgs, ag_sems);
  FIELD(AllReduceArgs, epochs);
  FIELD(AllReduceArgs, ll_offset);
  FIELD(AllReduceArgs, ll_half_bytes);
  FIELD(AllReduceArgs, ll_slot_bytes);
  FIELD(AllReduceArgs, pipe_offset);
  FIELD(AllReduceArgs, pipe_lane_bytes);
  FIELD(AllReduceArgs, tile_elems);
  FIELD(AllReduceArgs, lamport_offset);
  FIELD(AllReduceArgs, lamport_buf_bytes);
  FIELD(AllReduceArgs, lamport_slot_bytes);
  FIELD(AllReduceArgs, lamport_state);
  FIELD(AllReduceArgs, rank);
  FIELD(AllReduceArgs, world);
  FIELD(AllReduceArgs, site);
  FIELD(AllReduceArgs, call);

  STRUCT(AllReduceDirectArgs);
  FIELD(AllReduceDirectArgs, base);
  FIELD(AllReduceDirectArgs, peer_input);
  FIELD(AllReduceDirectArgs, peer_output);

  STRUCT(CallCheck);
  FIELD(CallCheck, word);
  FIELD(CallCheck, inbox);

  STRUCT(AllToAllArgs);
  FIELD(AllToAllArgs, input);
  FIELD(AllToAllArgs, output);
  FIELD(AllToAllArgs, counts);
  FIELD(AllToAllArgs, equal_bytes);
  FIELD(AllToAllArgs, scratch);
  FIELD(AllToAllArgs, data);
  FIELD(AllToAllArgs, credit);
  FIELD(AllToAllArgs, tile);
  FIELD(AllToAllArgs, rank);
  FIELD(AllToAllArgs, world);
  FIELD(AllToAllArgs, lanes);
  FIELD(AllToAllArgs, depth);
  FIELD(AllToAllArgs, send_threads);
  FIELD(AllToAllArgs, reserved);
  FIELD(AllToAllArgs, ll_offset);
  FIELD(AllToAllArgs, ll_slot_bytes);
  FIELD(AllToAllArgs, epochs);
  FIELD(AllToAllArgs, call);
  FIELD(AllToAllArgs, input_bytes);
  FIELD(AllToAllArgs, output_bytes);
  FIELD(AllToAllArgs, pair_ll_max);
  FIELD(AllToAllArgs, pair_epochs);

  STRUCT(MoeArgs);
  FIELD(MoeArgs, x);
  FIELD(MoeArgs, scales);
  FIELD(MoeArgs, topk_idx);
  FIELD(MoeArgs, topk_weights);
  FIELD(MoeArgs, y);
  FIELD(MoeArgs, out);
  FIELD(MoeArgs, num_tokens);
  FIELD(MoeArgs, hidden);
  FIELD(MoeArgs, topk);
  FIELD(MoeArgs, experts_per_rank);
  FIELD(MoeArgs, max_tokens);
  FIELD(MoeArgs, rank);
  FIELD(MoeArgs, world);
  FIELD(MoeArgs, blocks);
  FIELD(MoeArgs, land);
  FIELD(MoeArgs, comb_buf);
  FIELD(MoeArgs, off_idx);
  FIELD(MoeArgs, off_weights);
  FIELD(MoeArgs, off_src);
  FIELD(MoeArgs, off_matrix);
  FIELD(MoeArgs, off_scales);
  FIELD(MoeArgs, pos);
  FIELD(MoeArgs, num_recv);
  FIELD(MoeArgs, expert_counts);
  FIELD(MoeArgs, calls);
  FIELD(MoeArgs, sems);
  FIELD(MoeArgs, rank_prefix);
  FIELD(MoeArgs, y_weights);
  FIELD(MoeArgs, out_weights);
  FIELD(MoeArgs, off_comb_weights);
  FIELD(MoeArgs, in_rank);
  FIELD(MoeArgs, tokens_per_expert);
  FIELD(MoeArgs, off_expert_in);
  FIELD(MoeArgs, off_slots);
  FIELD(MoeArgs, slot_bytes);
  FIELD(MoeArgs, slot);
  FIELD(MoeArgs, fill_rows);
  FIELD(MoeArgs, call);

  STRUCT(MoeLlArgs);
  FIELD(MoeLlArgs, x);
  FIELD(MoeLlArgs, topk_idx);
  FIELD(MoeLlArgs, topk_weights);
  FIELD(MoeLlArgs, out);
  FIELD(MoeLlArgs, num_tokens);
  FIELD(MoeLlArgs, hidden);
  FIELD(MoeLlArgs, topk);
  FIELD(MoeLlArgs, experts_per_rank);
  FIELD(MoeLlArgs, max_tokens);
  FIELD(MoeLlArgs, rank);
  FIELD(MoeLlArgs, world);
  FIELD(MoeLlArgs, blocks);
  FIELD(MoeLlArgs, area);
  FIELD(MoeLlArgs, off_src);
  FIELD(MoeLlArgs, off_counts);
  FIELD(MoeLlArgs, off_from);
  FIELD(MoeLlArgs, off_weight);
  FIELD(MoeLlArgs, off_rec);
  FIELD(MoeLlArgs, off_part);
  FIELD(MoeLlArgs, off_queue);
  FIELD(MoeLlArgs, off_sent);
  FIELD(MoeLlArgs, y);
  FIELD(MoeLlArgs, fill);
  FIELD(MoeLlArgs, done);
  FIELD(MoeLlArgs, epochs);
  FIELD(MoeLlArgs, layout);
  FIELD(MoeLlArgs, recv_count);
  FIELD(MoeLlArgs, ready);
  FIELD(MoeLlArgs, call);
  FIELD(MoeLlArgs, packed_x);
  FIELD(MoeLlArgs, packed_scales);
  FIELD(MoeLlArgs, packed_src);
  FIELD(MoeLlArgs, packed_range);
  FIELD(MoeLlArgs, packed_count);
  FIELD(MoeLlArgs, packed_stats);
  FIELD(MoeLlArgs, off_ret);
  FIELD(MoeLlArgs, packed);
  FIELD(MoeLlArgs, packed_pad);
  FIELD(MoeLlArgs, ticket);
  FIELD(MoeLlArgs, rank_mask);
  FIELD(MoeLlArgs, wait_cycles);

  STRUCT(MoeNetArgs);
  FIELD(MoeNetArgs, x);
  FIELD(MoeNetArgs, scales);
  FIELD(MoeNetArgs, topk_idx);
  FIELD(MoeNetArgs, topk_weights);
  FIELD(MoeNetArgs, out);
  FIELD(MoeNetArgs, num_tokens);
  FIELD(MoeNetArgs, fp8);
  FIELD(MoeNetArgs, hidden);
  FIELD(MoeNetArgs, topk);
  FIELD(MoeNetArgs, experts_per_rank);
  FIELD(MoeNetArgs, max_tokens);
  FIELD(MoeNetArgs, rank);
  FIELD(MoeNetArgs, world);
  FIELD(MoeNetArgs, msg_bytes);
  FIELD(MoeNetArgs, header_bytes);
  FIELD(MoeNetArgs, area);
  FIELD(MoeNetArgs, peer_area);
  FIELD(MoeNetArgs, channels);
  FIELD(MoeNetArgs, sites);
  FIELD(MoeNetArgs, stage);
  FIELD(MoeNetArgs, off_counts);
  FIELD(MoeNetArgs, off_part);
  FIELD(MoeNetArgs, off_cdone);
  FIELD(MoeNetArgs, stage_counts);
  FIELD(MoeNetArgs, stage_part);
  FIELD(MoeNetArgs, y);
  FIELD(MoeNetArgs, recv_x);
  FIELD(MoeNetArgs, recv_src);
  FIELD(MoeNetArgs, recv_weights);
  FIELD(MoeNetArgs, recv_scales);
  FIELD(MoeNetArgs, rec);
  FIELD(MoeNetArgs, msgs);
  FIELD(MoeNetArgs, fill);
  FIELD(MoeNetArgs, done);
  FIELD(MoeNetArgs, epochs);
  FIELD(MoeNetArgs, layout);
  FIELD(MoeNetArgs, recv_count);
  FIELD(MoeNetArgs, list);
  FIELD(MoeNetArgs, probe);
  FIELD(MoeNetArgs, arrived);
  FIELD(MoeNetArgs, staged);
  FIELD(MoeNetArgs, call_word);
  FIELD(MoeNetArgs, off_inbox);
  FIELD(MoeNetArgs, stage_words);
  FIELD(MoeNetArgs, packed_x);
  FIELD(MoeNetArgs, packed_scales);
  FIELD(MoeNetArgs, packed_src);
  FIELD(MoeNetArgs, packed_range);
  FIELD(MoeNetArgs, packed_count);
  FIELD(MoeNetArgs, packed_stats);
  FIELD(MoeNetArgs, ticket);
  FIELD(MoeNetArgs, in_x);
  FIELD(MoeNetArgs, in_ids);
  FIELD(MoeNetArgs, packed);
  FIELD(MoeNetArgs, back);

  STRUCT(MoeHtArgs);
  FIELD(MoeHtArgs, nodes);
  FIELD(MoeHtArgs, node);
  FIELD(MoeHtArgs, rail);
  FIELD(MoeHtArgs, node_of);
  FIELD(MoeHtArgs, local_of);
  FIELD(MoeHtArgs, fwd_x);
  FIELD(MoeHtArgs, fwd_scales);
  FIELD(MoeHtArgs, fwd_idx);
  FIELD(MoeHtArgs, fwd_w);
  FIELD(MoeHtArgs, fwd_origin);
  FIELD(MoeHtArgs, fwd_out);
  FIELD(MoeHtArgs, net_rows);
  FIELD(MoeHtArgs, node_src);
  FIELD(MoeHtArgs, node_num_recv);
  FIELD(MoeHtArgs, origin_of);
  FIELD(MoeHtArgs, recv_src);
  FIELD(MoeHtArgs, chunks);
  FIELD(MoeHtArgs, weights);
  FIELD(MoeHtArgs, off_ring);
  FIELD(MoeHtArgs, off_desc);
  FIELD(MoeHtArgs, stage_desc);
  FIELD(MoeHtArgs, credits);
  FIELD(MoeHtArgs, sent_chunks);
  FIELD(MoeHtArgs, recv_chunks);
  FIELD(MoeHtArgs, list);
  FIELD(MoeHtArgs, node_counts);
  FIELD(MoeHtArgs, node_rows);
  FIELD(MoeHtArgs, node_max_rows);
  FIELD(MoeHtArgs, fwd_wout);
  FIELD(MoeHtArgs, w_out);
  FIELD(MoeHtArgs, off_part_w);
  FIELD(MoeHtArgs, stage_part_w);
  FIELD(MoeHtArgs, in_rank);
  FIELD(MoeHtArgs, fwd_in_rank);
  FIELD(MoeHtArgs, tokens_per_expert);
  FIELD(MoeHtArgs, fwd_tpe);
  FIELD(MoeHtArgs, tok_nodes);
  FIELD(MoeHtArgs, desc_bytes);
  FIELD(MoeHtArgs, by_rank);

  STRUCT(HtChunkDesc);
  FIELD(HtChunkDesc, epoch);
  FIELD(HtChunkDesc, messages);
  FIELD(HtChunkDesc, last);

  STRUCT(LamportState);
  FIELD(LamportState, call);
  FIELD(LamportState, reserved);
  FIELD(LamportState, prev_count);

  STRUCT(LL16Packet);
  FIELD(LL16Packet, data1);
  FIELD(LL16Packet, flag1);
  FIELD(LL16Packet, data2);
  FIELD(LL16Packet, flag2);

  STRUCT(LL8Packet);
  FIELD(LL8Packet, data);
  FIELD(LL8Packet, flag);

  CONST(kMaxRanks);
  CONST(kInboxWords);
  CONST(kPipeDepth);
  CONST(kHtMaxLocalExperts);
  CONST(kLlMaxPairs);
  CONST(kHtChunk);
  CONST(moe_net::kMaxRanks);
  CONST(moe_net::kStageParts);
  CONST(moe_net::kMaxPackPairs);
  CONST(kTriggerData);
  CONST(kTriggerFlag);
  CONST(kTriggerFlush);
  CONST(kWaitSemaphore);
  CONST(kWaitPacket);
  CONST(kWaitFifoSlot);
  CONST(kWaitFlush);
  CONST(kWaitProxyStopped);
  CONST(kWaitBadTrigger);
  CONST(kWaitBadInput);
  CONST(kWaitIbProgress);
  CONST(kWaitIbError);
  CONST(kWaitArgMismatch);
  CONST(kWaitBadCounts);
  return 0;
}
