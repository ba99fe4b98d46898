// core/machine.h — what the machine this process runs on can give it, in one place: the limits a
// run's options are checked against before any work (apps/trainer.cpp: --threads).
#pragma once

namespace tally {

// The hardware threads this process may run on at once (its CPU affinity mask, else the online
// processors); 0 when unknown.
int hardware_threads();

}  // namespace tally
