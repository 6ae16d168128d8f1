// What it costs the device to go from one CUDA graph launch to the next, by node count, and
// whether a loop on the device (a while conditional node around one step's graph) avoids it.
//
// A decode step replays a graph of ~180 (SmolLM2) to ~290 (8B) small kernels. Traced on an H100
// (bench/RESULTS.md), the device idles ~0.2-0.3 ms between steps while the host is inside
// cudaGraphLaunch, and launching the next step ahead (before the previous one finished) did not
// shorten a step. This separates the parts with synthetic kernels that each spin for --spin-us
// on --blocks blocks, --nodes of them in a step, --steps steps, five ways:
//   eager       ordinary launches, the host never waits until the end
//   graph sync  one graph a step, the host waits for each (what the decoder does today)
//   graph ahead one graph a step, launched back to back, one wait at the end
//   two graphs  the same with two executable copies launched in turn
//   while loop  one launch: a while node runs the step's graph --steps times on the device
//               (its kernels launched plainly even with --pdl)
// The ideal is nodes x spin a step; each row gives ms a step and its excess over the ideal.
//   talon_bench_graphs [--nodes 184,290] [--spin-us 3] [--blocks 132] [--steps 200] [--pdl]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "talon_bench_graphs: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins for `ns` nanoseconds (the global timer), then block 0 bumps a counter. Launched as a
// programmatic dependent (--pdl), it lets the next kernel start early and waits for the one
// before it first, as the decoder's kernels do.
__global__ void spin_kernel(unsigned long long ns, int* counter) {
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const unsigned long long t0 = global_ns();
  while (global_ns() - t0 < ns) {
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counter, 1);
}

// The while loop's last node: counts down the steps left and stops the loop at 0.
__global__ void countdown_kernel(cudaGraphConditionalHandle h, int* left) {
  if (threadIdx.x == 0) {
    const int v = --*left;
    cudaGraphSetConditional(h, v > 0 ? 1u : 0u);
  }
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Device cost of going from one CUDA graph to the next (synthetic kernels)"};
  std::vector<int> nodes{184, 290};
  double spin_us = 3.0;
  int blocks = 132, steps = 200;
  bool pdl = false;
  app.add_option("--nodes", nodes, "kernels a step")->delimiter(',');
  app.add_option("--spin-us", spin_us, "each kernel's spin")->capture_default_str();
  app.add_option("--blocks", blocks, "each kernel's blocks")->capture_default_str();
  app.add_option("--steps", steps, "steps timed")->capture_default_str();
  app.add_flag("--pdl", pdl, "launch the kernels as programmatic dependents (the decoder's launches)");
  CLI11_PARSE(app, argc, argv);
  if (steps < 1 || blocks < 1 || !(spin_us >= 0) || nodes.empty()) {
    std::fprintf(stderr, "talon_bench_graphs: --steps and --blocks must be >= 1, --spin-us >= 0, --nodes given\n");
    return 2;
  }
  for (int k : nodes)
    if (k < 1) {
      std::fprintf(stderr, "talon_bench_graphs: --nodes %d: each step needs at least one kernel\n", k);
      return 2;
    }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  int *counter = nullptr, *left = nullptr;
  check(cudaMalloc(&counter, sizeof(int)), "malloc");
  check(cudaMalloc(&left, sizeof(int)), "malloc");
  const auto ns = static_cast<unsigned long long>(spin_us * 1000.0);
  std::printf("%s: kernels of %d blocks spinning %.1f us, %d steps%s\n", prop.name, blocks, spin_us, steps,
              pdl ? ", programmatic dependent launches" : "");
  std::printf("%6s %-12s %10s %10s %12s\n", "nodes", "way", "ms a step", "ideal ms", "excess us");
  for (int K : nodes) {
    auto step = [&](cudaStream_t st, bool dependent) {
      for (int i = 0; i < K; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(unsigned(blocks));
        cfg.blockDim = dim3(32);
        cfg.stream = st;
        cudaLaunchAttribute attr = {};
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = dependent ? 1 : 0;
        check(cudaLaunchKernelEx(&cfg, spin_kernel, ns, counter), "launch");
      }
    };
    auto capture = [&](const std::function<void()>& work) {
      cudaGraph_t g = nullptr;
      check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
      work();
      check(cudaStreamEndCapture(s, &g), "end capture");
      cudaGraphExec_t e = nullptr;
      check(cudaGraphInstantiate(&e, g, 0), "instantiate");
      check(cudaGraphDestroy(g), "destroy");
      return e;
    };
    cudaGraphExec_t one = capture([&] { step(s, pdl); }), two = capture([&] { step(s, pdl); });
    // The while loop: a graph holding one conditional node whose body is a step and the countdown.
    cudaGraph_t loop = nullptr;
    check(cudaGraphCreate(&loop, 0), "graph");
    cudaGraphConditionalHandle h{};
    check(cudaGraphConditionalHandleCreate(&h, loop, 1, cudaGraphCondAssignDefault), "conditional handle");
    cudaGraphNodeParams np{};
    np.type = cudaGraphNodeTypeConditional;
    np.conditional.handle = h;
    np.conditional.type = cudaGraphCondTypeWhile;
    np.conditional.size = 1;
    cudaGraphNode_t node = nullptr;
    check(cudaGraphAddNode(&node, loop, nullptr, nullptr, 0, &np), "conditional node");
    cudaGraph_t body = np.conditional.phGraph_out[0];
    check(cudaStreamBeginCaptureToGraph(s, body, nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal),
          "capture the body");
    step(s, false);  // plain launches: whether a conditional body takes programmatic edges is untried
    countdown_kernel<<<1, 32, 0, s>>>(h, left);
    check(cudaStreamEndCapture(s, &body), "end the body");
    cudaGraphExec_t looped = nullptr;
    check(cudaGraphInstantiate(&looped, loop, 0), "instantiate the loop");

    auto timed = [&](const char* way, const std::function<void()>& run) {
      run();  // warm: uploads, first launches
      check(cudaStreamSynchronize(s), "warm");
      const double t0 = now();
      run();
      check(cudaStreamSynchronize(s), way);
      const double per = (now() - t0) / double(steps);
      const double ideal = double(K) * spin_us * 1e-6;
      std::printf("%6d %-12s %10.3f %10.3f %12.1f\n", K, way, per * 1e3, ideal * 1e3, (per - ideal) * 1e6);
    };
    timed("eager", [&] {
      for (int i = 0; i < steps; ++i) step(s, pdl);
    });
    timed("graph sync", [&] {
      for (int i = 0; i < steps; ++i) {
        check(cudaGraphLaunch(one, s), "launch");
        check(cudaStreamSynchronize(s), "sync");
      }
    });
    timed("graph ahead", [&] {
      for (int i = 0; i < steps; ++i) check(cudaGraphLaunch(one, s), "launch");
    });
    timed("two graphs", [&] {
      for (int i = 0; i < steps; ++i) check(cudaGraphLaunch(i % 2 ? two : one, s), "launch");
    });
    timed(pdl ? "while, plain" : "while loop", [&] {
      check(cudaMemcpyAsync(left, &steps, sizeof(int), cudaMemcpyHostToDevice, s), "steps up");
      check(cudaGraphLaunch(looped, s), "launch the loop");
    });
    check(cudaGraphExecDestroy(one), "destroy");
    check(cudaGraphExecDestroy(two), "destroy");
    check(cudaGraphExecDestroy(looped), "destroy");
    check(cudaGraphDestroy(loop), "destroy");
  }
  cudaFree(counter);
  cudaFree(left);
  cudaStreamDestroy(s);
  return 0;
}
