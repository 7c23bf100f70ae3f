// Access to the CUDA driver the core loaded (launch.cc), for the core's other files (timing.cc).
#ifndef DIETCODE_DRIVER_H_
#define DIETCODE_DRIVER_H_

#include <string>

namespace dietcode {

// The libcuda symbol `name` (an exact, versioned name such as "cuMemAlloc_v2") from the library the core
// opened with dlopen, after cuInit succeeded. nullptr with a message in *error when the driver cannot be
// used or lacks the symbol.
void* DriverSymbol(const char* name, std::string* error);

}  // namespace dietcode

#endif  // DIETCODE_DRIVER_H_
