// The decode loop of decode_example.cpp with expert parallelism: N processes (default 2; the
// first argument), rank r holding experts [r E / N, (r + 1) E / N) on GPU r % GPUs (several
// ranks share a GPU where the machine has fewer), each a uniep::cuda::MoeLayer over the N ranks
// made from rank 0's unique id, which a pipe carries as a server's own transport would. Every
// rank runs its own tokens, 1 to 512 a step, eagerly and as a CUDA graph replayed on new tokens
// and routing; its output must have the bits of a world-1 MoeLayer on all the experts (the
// layer's bits do not depend on the world size) and be within bf16 rounding of the CPU executor.
//
// The processes are forked before any CUDA call; each ends within kRankSeconds (an alarm) so a
// rank that never comes cannot leave the others waiting. Without a CUDA device every rank says
// so and exits 0. Prints OK and exits 0, or names the first mismatch or failed rank and exits 1.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <uniep/cuda/ep.hpp>
#include <uniep/cuda/moe_layer.hpp>
#include <uniep/status.hpp>

#include "decode_steps.hpp"
#include "example_support.hpp"

namespace {

using decode::cpu_forward;
using decode::device_copy;
using decode::download;
using decode::kExperts;
using decode::kFfn;
using decode::kHidden;
using decode::kMaxTokens;
using decode::kSteps;
using decode::make_step;
using decode::relative_error;
using decode::Step;
using decode::widen;
using example::check;
using example::check_cuda;

constexpr unsigned kRankSeconds = 300;

int failures = 0;
int my_rank = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("rank %d: MISMATCH: %s\n", my_rank, what.c_str());
    ++failures;
  }
}

void write_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) {
      std::printf("rank %d: FAILED: writing the unique id to a pipe\n", my_rank);
      std::exit(1);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void read_all(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) {  // rank 0 died before sending it
      std::printf("rank %d: FAILED: rank 0's unique id never came\n", my_rank);
      std::exit(1);
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// Rank 0 makes the unique id and writes it to every other rank's pipe; the others read theirs.
std::vector<uint8_t> share_unique_id(int rank, const std::vector<int>& to_ranks, int from_rank0) {
  std::vector<uint8_t> id;
  if (rank == 0) {
    check(uniep::ep::make_unique_id(&id), "uniep::ep::make_unique_id");
    const uint64_t size = id.size();
    for (int fd : to_ranks) {
      write_all(fd, &size, sizeof size);
      write_all(fd, id.data(), id.size());
    }
  } else {
    uint64_t size = 0;
    read_all(from_rank0, &size, sizeof size);
    id.resize(size);
    read_all(from_rank0, id.data(), id.size());
  }
  return id;
}

int run_rank(int rank, int ranks, const std::vector<int>& to_ranks, int from_rank0) {
  my_rank = rank;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("rank %d: no CUDA device: the decode loop across ranks is skipped\n", rank);
    return 0;
  }
  check_cuda(cudaSetDevice(rank % devices), "cudaSetDevice");
  std::vector<uint16_t> w1, w2;
  decode::make_weights(&w1, &w2);

  uniep::cuda::MoeLayerConfig config = decode::layer_config();
  config.timeout_s = 60;
  uniep::cuda::MoeLayerConfig local = config;  // every expert on this GPU: the bits to match
  config.world_size = ranks;
  config.rank = rank;
  // The symmetric heap holds the layer's buffers and NVSHMEM's own (a margin); set before the
  // process starts NVSHMEM, unless the environment already does.
  const size_t heap = uniep::cuda::MoeLayer::symmetric_heap_bytes(config) + (size_t{512} << 20);
  setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(heap).c_str(), 0);
  const std::vector<uint8_t> id = share_unique_id(rank, to_ranks, from_rank0);
  std::unique_ptr<uniep::cuda::MoeLayer> layer, whole;
  check(uniep::cuda::MoeLayer::create(config, id, &layer), "MoeLayer::create (across ranks)");
  check(uniep::cuda::MoeLayer::create(local, &whole), "MoeLayer::create (world 1)");

  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  // This rank's experts, and all of them for the world-1 layer.
  const int64_t per_rank = kExperts / ranks;
  const size_t w1_slice = per_rank * kHidden * 2 * kFfn, w2_slice = per_rank * kFfn * kHidden;
  uint16_t* d_w1_all = device_copy(w1, w1.size());
  uint16_t* d_w2_all = device_copy(w2, w2.size());
  const decode::StepBuffers buf = decode::StepBuffers::allocate();
  uint16_t* d_want = device_copy(std::vector<uint16_t>{}, kMaxTokens * kHidden);

  for (int64_t tokens : kSteps) {
    const uniep::cuda::MoeLayerInputs in =
        buf.inputs(tokens, d_w1_all + rank * w1_slice, d_w2_all + rank * w2_slice);
    uniep::cuda::MoeLayerInputs all = buf.inputs(tokens, d_w1_all, d_w2_all);
    all.out = d_want;
    const size_t n = tokens * kHidden;
    const std::string at = " at " + std::to_string(tokens) + " tokens";

    // Eager: every rank its own tokens (the seeds differ by rank).
    const Step a = make_step(tokens, 1000 * rank + 100 + tokens);
    buf.upload(a, stream);
    check(layer->forward(in, stream), "MoeLayer::forward (across ranks)");
    check(layer->check(stream), "MoeLayer::check (eager)");
    check(whole->forward(all, stream), "MoeLayer::forward (world 1)");
    check(whole->check(stream), "MoeLayer::check (world 1)");
    const std::vector<uint16_t> eager = download(buf.out, n, stream);
    expect(eager == download(d_want, n, stream),
           "the layer across ranks differs from the world-1 layer" + at);
    const double err_a = relative_error(eager, widen(cpu_forward(a, w1, w2)));

    // Captured once on every rank, replayed on the same tokens and on new ones.
    cudaGraphExec_t exec = decode::capture_forward(*layer, in, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(layer->check(stream), "MoeLayer::check (replay)");
    expect(download(buf.out, n, stream) == eager, "the replay differs from the eager call" + at);

    const Step b = make_step(tokens, 1000 * rank + 200 + tokens);
    buf.upload(b, stream);
    const double us = decode::replay_us(exec, 10, stream);
    check(layer->check(stream), "MoeLayer::check (new tokens)");
    const std::vector<uint16_t> replayed = download(buf.out, n, stream);
    check(whole->forward(all, stream), "MoeLayer::forward (world 1)");
    expect(replayed == download(d_want, n, stream),
           "a replay on new tokens differs from the world-1 layer" + at);
    const double err_b = relative_error(replayed, widen(cpu_forward(b, w1, w2)));
    std::printf(
        "rank %d, %3lld tokens: the world-1 layer's bits; relative error %.3g (eager), %.3g "
        "(graph on new tokens) against the CPU executor; %.1f us a replay (ranks sharing a GPU "
        "time each other)\n",
        rank, static_cast<long long>(tokens), err_a, err_b, us);
    expect(err_a < 2e-2 && err_b < 2e-2, "the output against the CPU executor" + at);
    check_cuda(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  }

  layer.reset();  // collective: every rank frees its symmetric memory
  whole.reset();
  buf.free();
  for (void* p :
       {static_cast<void*>(d_w1_all), static_cast<void*>(d_w2_all), static_cast<void*>(d_want)})
    cudaFree(p);
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 2;
  if (ranks < 2 || kExperts % ranks != 0) {
    std::printf("FAILED: ranks must be >= 2 and divide the %lld experts, got %s\n",
                static_cast<long long>(kExperts), argc > 1 ? argv[1] : "?");
    return 1;
  }
  // One pipe from rank 0 to each other rank, made before the fork.
  std::vector<int> read_end(ranks, -1), write_end(ranks, -1);
  for (int r = 1; r < ranks; ++r) {
    int fds[2];
    if (pipe(fds) != 0) {
      std::printf("FAILED: pipe\n");
      return 1;
    }
    read_end[r] = fds[0];
    write_end[r] = fds[1];
  }
  std::vector<pid_t> pids(ranks, -1);
  std::fflush(stdout);  // nothing of the parent's buffer printed again by the children
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::printf("FAILED: fork of rank %d\n", r);
      return 1;
    }
    if (pid == 0) {
      alarm(kRankSeconds);
      std::vector<int> to_ranks;
      for (int q = 1; q < ranks; ++q) {
        if (r == 0)
          to_ranks.push_back(write_end[q]);
        else
          close(write_end[q]);
        if (q != r) close(read_end[q]);
      }
      std::exit(run_rank(r, ranks, to_ranks, r == 0 ? -1 : read_end[r]));
    }
    pids[r] = pid;
  }
  for (int r = 1; r < ranks; ++r) {
    close(read_end[r]);
    close(write_end[r]);
  }
  int failed = 0;
  for (int r = 0; r < ranks; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (WIFSIGNALED(status)) {
      std::printf(
          "FAILED: rank %d ended by signal %d%s\n", r, WTERMSIG(status),
          WTERMSIG(status) == SIGALRM ? " (it outlived its alarm: a rank never came?)" : "");
      ++failed;
    } else if (WEXITSTATUS(status) != 0) {
      std::printf("FAILED: rank %d exited with %d\n", r, WEXITSTATUS(status));
      ++failed;
    }
  }
  if (failed != 0) return 1;
  std::printf("OK (%d ranks)\n", ranks);
  return 0;
}
