// The subcommands of the dsv41 tool. Each takes the arguments after its name.
#pragma once

namespace dsv41 {
class MpiJob;  // parallel/mpi_job.h
}

namespace dsv41::cli {

bool wants_help(int argc, char** argv);

int run_inspect(int argc, char** argv);
int run_make_tiny(int argc, char** argv);
// generate, bench and serve take --expert-parallel; `job` is then the MPI job they run in
// (tools/expert_parallel.h).
int run_generate(int argc, char** argv, MpiJob* job = nullptr);
int run_logits_diff(int argc, char** argv);
int run_bench(int argc, char** argv, MpiJob* job = nullptr);
int run_serve(int argc, char** argv, MpiJob* job = nullptr);
int run_chat(int argc, char** argv);
int run_ppl(int argc, char** argv);
int run_tokenizer(int argc, char** argv);
int run_pack(int argc, char** argv);
int run_plan(int argc, char** argv);
int run_vision_encode(int argc, char** argv);

}  // namespace dsv41::cli
