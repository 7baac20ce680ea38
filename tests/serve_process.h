// `dsv41 serve` run as a child process for tests that need the real command (its flags, its
// signal handling), not an in-process HttpServer.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "test_paths.h"

namespace dsv41::server {

// `dsv41 serve` as a child process; its first stdout line names the address. `launcher` goes before
// the binary (e.g. "mpirun -np 2"); the child leads a process group of its own, which the destructor
// kills whole (an MPI job's other ranks with it).
class ServeProcess {
 public:
  ServeProcess(const std::string& model_dir, const std::string& extra_args, const std::string& launcher = "") {
    std::signal(SIGPIPE, SIG_IGN);  // as in LiveServer: the test client writes without MSG_NOSIGNAL
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      const std::string cmd = launcher + (launcher.empty() ? "" : " ") + test::dsv41_binary() + " serve -m '" + model_dir + "' --port 0 " + extra_args;
      execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    FILE* f = fdopen(out[0], "r");
    char line[512];
    if (f != nullptr && std::fgets(line, sizeof line, f) != nullptr) {
      first_line_ = line;
      const size_t colon = first_line_.rfind(':', first_line_.find(" (model"));
      if (colon != std::string::npos) port_ = std::atoi(first_line_.c_str() + colon + 1);
    }
    out_ = f;
  }
  ~ServeProcess() {
    if (pid_ > 0) kill(-pid_, SIGKILL);  // the group: whatever the child started is left
    if (pid_ > 0 && !exited_) waitpid(pid_, nullptr, 0);
    if (out_ != nullptr) fclose(out_);
  }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  // Whether any process of the child's group is still alive.
  bool group_alive() const { return pid_ > 0 && kill(-pid_, 0) == 0; }
  const std::string& first_line() const { return first_line_; }
  // Sends `sig` and returns the exit status (-1 if it did not exit within `seconds`).
  int stop(int sig, int seconds) {
    kill(pid_, sig);
    return wait(seconds);
  }
  // The exit status once it exits (-1 if it did not exit within `seconds`).
  int wait(int seconds) {
    for (int i = 0; i < seconds * 50; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  bool exited_ = false;
  std::string first_line_;
  FILE* out_ = nullptr;
};

}  // namespace dsv41::server
