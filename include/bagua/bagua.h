// Everything a C++ user of the runtime needs, in one include.
#pragma once

#include "bagua/comm/communicator.h"
#include "bagua/comm/gloo_communicator.h"
#include "bagua/comm/store.h"
#include "bagua/compression/compressor.h"
#include "bagua/core/dtype.h"
#include "bagua/core/elementwise.h"
#include "bagua/core/errors.h"
#include "bagua/core/tensor_view.h"
#include "bagua/ops/callback_op.h"
#include "bagua/ops/centralized_low_precision.h"
#include "bagua/ops/centralized_synchronous.h"
#include "bagua/ops/decentralized_low_precision.h"
#include "bagua/runtime/backend.h"
#include "bagua/runtime/bucket.h"
#include "bagua/runtime/planner.h"
