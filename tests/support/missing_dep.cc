// The dependency of tests/support/fake_cufile.cc that the test leaves out.
extern "C" __attribute__((visibility("default"))) int ctl_missing_dep_value() { return 0; }
