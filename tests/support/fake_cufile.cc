// A stand-in libcufile.so.0 for collectivectl doctor's GPU Direct Storage
// check: it loads only with libctl_missing_dep.so, which the test leaves out,
// as a real libcufile fails when one of its dependencies (libdl.so, ...) is
// missing.
extern "C" int ctl_missing_dep_value();
extern "C" __attribute__((visibility("default"))) int cuFileDriverOpen() {
  return ctl_missing_dep_value();
}
