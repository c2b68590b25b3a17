// The main() of every doctest executable that has no main of its own
// (DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN's, apart from the implementation in
// doctest_impl.cc). A static library member: linked only where main is
// missing, so gpu_test and the rdma tests keep theirs.
#include <doctest/doctest.h>

int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
