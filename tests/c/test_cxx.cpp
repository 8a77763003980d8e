// The header compiles as C++ and the library links from C++.
#include <cstdio>
#include <vector>

#include "roccl.h"

int main() {
  rocclComm_t comms[2];
  if (rocclCommInitAll(comms, 2, nullptr) != rocclSuccess) {
    std::fprintf(stderr, "init: %s\n", rocclGetLastError(nullptr));
    return 1;
  }
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  rocclGroupStart();
  rocclAllReduce(a.data(), a.data(), a.size(), rocclFloat, rocclSum, comms[0], nullptr);
  rocclAllReduce(b.data(), b.data(), b.size(), rocclFloat, rocclSum, comms[1], nullptr);
  rocclResult_t r = rocclGroupEnd();
  if (r != rocclSuccess || a[999] != 3.0f || b[0] != 3.0f) {
    std::fprintf(stderr, "allreduce: %s %g %g\n", rocclGetErrorString(r), a[999], b[0]);
    return 1;
  }
  for (auto c : comms) rocclCommDestroy(c);
  std::printf("test_cxx: ok\n");
  return 0;
}
