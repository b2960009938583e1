// Compiled without MPI on the include path.
#define LINK_TEST_UNIT plain_unit
#include "unit_body.hpp"
