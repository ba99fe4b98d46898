// cmake/lsan_openmpi.cpp — LeakSanitizer's suppressions in the sanitizer build (TALLY_SANITIZE=ON),
// linked into every program of that build (CMakeLists.txt): the blocks Open MPI's own libraries
// keep until the process ends (ompi_op_base_op_select, opal_argv_append_*, its components' state).
// A block is suppressed only when a frame of its allocation stack lies in one of Open MPI's three
// libraries, or in the libevent loop of Open MPI's progress thread (tally uses no libevent): a leak
// in tally's own code is still reported and fails its test (sanitize.leak_outside_openmpi_is_reported).
//
// Open MPI's components are plugins it unloads at MPI_Finalize, built without frame pointers:
// with the sanitizer's default fast unwinder a block they allocated has a one-frame stack in an
// "<unknown module>", which no suppression can name. The MPI tests therefore run with
// ASAN_OPTIONS=fast_unwind_on_malloc=0 (tests/CMakeLists.txt), whose stacks reach the Open MPI
// library that called the plugin.
//
// LeakSanitizer asks every program for this function; LSAN_OPTIONS=suppressions=FILE adds more.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libmpi.so\n"
         "leak:libopen-pal.so\n"
         "leak:libopen-rte.so\n"
         "leak:libevent_core\n";
}
