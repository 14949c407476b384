// Reads of memory that vanished: a source file truncated while it is mapped turns every
// read past its new end into SIGBUS, which kills the process. While a work item of the
// kernel runs, its thread is guarded: a SIGBUS there jumps back out of the item with the
// address that faulted, the call skips the items left and throws BusError (copy_kernel.hpp)
// with the address; the binding names the buffer, the caller the file behind it. A SIGBUS anywhere else goes to the
// handler that was there before (the default: the process ends, as without aoa).
#pragma once

#include <signal.h>

#include <csetjmp>

namespace aoa {

namespace bus {

inline thread_local sigjmp_buf* t_jump = nullptr;  // set while this thread runs an item
inline thread_local void* t_address = nullptr;
inline struct sigaction previous_action;

inline void on_bus_error(int signal, siginfo_t* info, void*) {
  if (t_jump != nullptr) {
    t_address = info->si_addr;
    siglongjmp(*t_jump, 1);
  }
  // Not ours: the handler from before takes it (raised again, as it comes on return).
  sigaction(signal, &previous_action, nullptr);
  raise(signal);
}

// Make on_bus_error the SIGBUS handler (again, if another was set since: Python's
// faulthandler, for one), keeping the one it replaces.
inline void install() {
  struct sigaction current {};
  sigaction(SIGBUS, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == &on_bus_error) return;
  struct sigaction ours {};
  ours.sa_sigaction = &on_bus_error;
  // SA_NODEFER: SIGBUS stays unblocked in the handler, so the jump out of it needs no
  // saved signal mask (sigsetjmp without one: no system call per item).
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&ours.sa_mask);
  sigaction(SIGBUS, &ours, &previous_action);
}

}  // namespace bus

// Runs `work()` on this thread with SIGBUS guarded (after install()); false if it faulted,
// the address in `fault`. The work must own nothing with a destructor (a fault leaves its
// frames without unwinding them).
template <typename Work>
bool run_guarded(const Work& work, void** fault) {
  sigjmp_buf jump;
  if (sigsetjmp(jump, 0) != 0) {
    bus::t_jump = nullptr;
    *fault = bus::t_address;
    return false;
  }
  bus::t_jump = &jump;
  work();
  bus::t_jump = nullptr;
  return true;
}

}  // namespace aoa
