// Timing compiled kernels as they ship, for the tuner (custom_ops/timing.cc): the bundle's cubin launched by
// dc_launch on a stream, timed with CUDA events, with device memory from the driver. Used by
// tuner/gpu_timing.py in a child process of its own, never by a session. Same conventions as core.h: a
// negative return leaves a message for dc_last_error().
#ifndef DIETCODE_TIMING_H_
#define DIETCODE_TIMING_H_

#include <stddef.h>
#include <stdint.h>

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

// Make device `device`'s primary context current on this thread and create a non-blocking stream in it
// (*stream receives the CUstream). Call once per process. 0 on success.
int dc_timing_open(int device, void** stream);

// Device memory in the current context: allocate (*ptr receives the address), free, copy from the host.
int dc_mem_alloc(uint64_t bytes, uint64_t* ptr);
int dc_mem_free(uint64_t ptr);
int dc_mem_upload(uint64_t dst, const void* src, uint64_t bytes);

// Time kernel k of `bundle` with `args` on `stream`: `warmup` launches (the first loads the module) and a
// synchronization, then `repeat` timed launches, each preceded by writing `flush_bytes` at `flush` (evicts
// L2 and keeps the GPU busy while the host enqueues the launch; 0 bytes: no flush) and bracketed by a CUDA
// event pair; ms_out[i] receives launch i's milliseconds. Each launch goes through dc_launch, so it includes
// what the runtime does per call (a split-K kernel's counters kept for the stream, zeroed at the warm-up's first
// launch only, as in a session; a TMA kernel's global scratch from the workspace; args must give it:
// dc_kernel_workspace_bytes). Returns 0 on success; -1 on an
// error that leaves the context usable (bad arguments, a launch the kernel refuses, out of resources);
// -2 on an error that poisons the context (illegal address, launch failure, ...): nothing more can run
// in this process.
int dc_time_kernel(dc_bundle* bundle, int32_t k, const dc_launch_args* args, void* stream, int warmup,
                   int repeat, uint64_t flush, uint64_t flush_bytes, float* ms_out);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // DIETCODE_TIMING_H_
