// The ABI facts of an nccl.h, as (name, value) text: enumerator values, struct
// sizes and field offsets, the initializers' values, version macros, and each
// function's type as the C++ ABI mangles it (which spells out every parameter
// type by name). Included after one nccl.h, by abi_ref.cc (NVIDIA's) and
// abi_ours.cc (ours); abi_test.cc compares the two tables.
#include <cstddef>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace abi {

using Table = std::vector<std::pair<std::string, std::string>>;

template <typename T>
std::string num(T v) {
  return std::to_string(static_cast<long long>(v));
}

}  // namespace abi

#define ABI_VALUE(x) t.emplace_back(#x, abi::num(x));
#define ABI_FIELD(s, f)                                                 \
  t.emplace_back("offsetof(" #s ", " #f ")", abi::num(offsetof(s, f))); \
  t.emplace_back("sizeof(" #s "." #f ")", abi::num(sizeof(s::f)));
#define ABI_FUNCTION(f) t.emplace_back("type of " #f, typeid(&f).name());

#define ABI_TABLE(name)                                                                                          \
  abi::Table name() {                                                                                            \
    abi::Table t;                                                                                                \
    ABI_VALUE(NCCL_MAJOR)                                                                                        \
    ABI_VALUE(NCCL_MINOR) ABI_VALUE(NCCL_PATCH) ABI_VALUE(NCCL_VERSION_CODE) ABI_VALUE(NCCL_VERSION(             \
        2, 8,                                                                                                    \
        4)) ABI_VALUE(NCCL_VERSION(2, 28,                                                                        \
                                   9)) ABI_VALUE(NCCL_UNIQUE_ID_BYTES) ABI_VALUE(sizeof(ncclUniqueId))           \
        ABI_VALUE(alignof(ncclUniqueId)) ABI_VALUE(ncclSuccess) ABI_VALUE(ncclUnhandledCudaError) ABI_VALUE(     \
            ncclSystemError) ABI_VALUE(ncclInternalError) ABI_VALUE(ncclInvalidArgument)                         \
            ABI_VALUE(ncclInvalidUsage) ABI_VALUE(ncclRemoteError) ABI_VALUE(ncclInProgress) ABI_VALUE(          \
                ncclNumResults) ABI_VALUE(sizeof(ncclResult_t)) ABI_VALUE(ncclSum) ABI_VALUE(ncclProd)           \
                ABI_VALUE(ncclMax) ABI_VALUE(ncclMin) ABI_VALUE(ncclAvg) ABI_VALUE(ncclNumOps) ABI_VALUE(        \
                    ncclMaxRedOp) ABI_VALUE(sizeof(ncclRedOp_t)) ABI_VALUE(ncclInt8) ABI_VALUE(ncclChar)         \
                    ABI_VALUE(ncclUint8) ABI_VALUE(ncclInt32) ABI_VALUE(ncclInt) ABI_VALUE(                      \
                        ncclUint32) ABI_VALUE(ncclInt64) ABI_VALUE(ncclUint64) ABI_VALUE(ncclFloat16)            \
                        ABI_VALUE(ncclHalf) ABI_VALUE(ncclFloat32) ABI_VALUE(ncclFloat) ABI_VALUE(               \
                            ncclFloat64) ABI_VALUE(ncclDouble) ABI_VALUE(ncclBfloat16)                           \
                            ABI_VALUE(ncclFloat8e4m3) ABI_VALUE(ncclFloat8e5m2) ABI_VALUE(                       \
                                ncclNumTypes) ABI_VALUE(sizeof(ncclDataType_t))                                  \
                                ABI_VALUE(ncclScalarDevice) ABI_VALUE(ncclScalarHostImmediate) ABI_VALUE(        \
                                    NCCL_CONFIG_UNDEF_INT) ABI_VALUE(NCCL_SPLIT_NOCOLOR)                         \
                                    ABI_VALUE(NCCL_WIN_DEFAULT) ABI_VALUE(NCCL_WIN_COLL_SYMMETRIC) ABI_VALUE(    \
                                        NCCL_WIN_REQUIRED_ALIGNMENT) ABI_VALUE(NCCL_CTA_POLICY_DEFAULT)          \
                                        ABI_VALUE(NCCL_CTA_POLICY_EFFICIENCY) ABI_VALUE(                         \
                                            NCCL_CTA_POLICY_ZERO) ABI_VALUE(NCCL_SHRINK_DEFAULT)                 \
                                            ABI_VALUE(NCCL_SHRINK_ABORT) ABI_VALUE(                              \
                                                NCCL_REVOKE_DEFAULT) ABI_VALUE(sizeof(ncclConfig_t))             \
                                                ABI_VALUE(alignof(ncclConfig_t)) ABI_FIELD(                      \
                                                    ncclConfig_t,                                                \
                                                    size) ABI_FIELD(ncclConfig_t,                                \
                                                                    magic) ABI_FIELD(ncclConfig_t,               \
                                                                                     version)                    \
                                                    ABI_FIELD(ncclConfig_t, blocking) ABI_FIELD(                 \
                                                        ncclConfig_t,                                            \
                                                        cgaClusterSize) ABI_FIELD(ncclConfig_t,                  \
                                                                                  minCTAs)                       \
                                                        ABI_FIELD(ncclConfig_t, maxCTAs) ABI_FIELD(              \
                                                            ncclConfig_t,                                        \
                                                            netName) ABI_FIELD(ncclConfig_t,                     \
                                                                               splitShare)                       \
                                                            ABI_FIELD(ncclConfig_t, trafficClass) ABI_FIELD(     \
                                                                ncclConfig_t,                                    \
                                                                commName) ABI_FIELD(ncclConfig_t,                \
                                                                                    collnetEnable)               \
                                                                ABI_FIELD(ncclConfig_t, CTAPolicy) ABI_FIELD(    \
                                                                    ncclConfig_t,                                \
                                                                    shrinkShare) ABI_FIELD(ncclConfig_t,         \
                                                                                           nvlsCTAs)             \
                                                                    ABI_FIELD(ncclConfig_t,                      \
                                                                              nChannelsPerNetPeer)               \
                                                                        ABI_FIELD(                               \
                                                                            ncclConfig_t,                        \
                                                                            nvlinkCentricSched)                  \
                                                                            ABI_VALUE(sizeof(                    \
                                                                                ncclSimInfo_t))                  \
                                                                                ABI_FIELD(                       \
                                                                                    ncclSimInfo_t,               \
                                                                                    size)                        \
                                                                                    ABI_FIELD(                   \
                                                                                        ncclSimInfo_t,           \
                                                                                        magic)                   \
                                                                                        ABI_FIELD(               \
                                                                                            ncclSimInfo_t,       \
                                                                                            version)             \
                                                                                            ABI_FIELD(           \
                                                                                                ncclSimInfo_t,   \
                                                                                                estimatedTime) { \
      ncclConfig_t c = NCCL_CONFIG_INITIALIZER;                                                                  \
      ABI_VALUE(c.size)                                                                                          \
      ABI_VALUE(c.magic) ABI_VALUE(c.version) ABI_VALUE(c.blocking) ABI_VALUE(c.cgaClusterSize)                  \
          ABI_VALUE(c.minCTAs) ABI_VALUE(c.maxCTAs) ABI_VALUE(c.netName == nullptr)                              \
              ABI_VALUE(c.splitShare) ABI_VALUE(c.trafficClass) ABI_VALUE(c.commName == nullptr)                 \
                  ABI_VALUE(c.collnetEnable) ABI_VALUE(c.CTAPolicy) ABI_VALUE(c.shrinkShare)                     \
                      ABI_VALUE(c.nvlsCTAs) ABI_VALUE(c.nChannelsPerNetPeer)                                     \
                          ABI_VALUE(c.nvlinkCentricSched) ncclSimInfo_t s =                                      \
                              NCCL_SIM_INFO_INITIALIZER;                                                         \
      ABI_VALUE(s.size) ABI_VALUE(s.magic) ABI_VALUE(s.version) ABI_VALUE(s.estimatedTime)                       \
    }                                                                                                            \
    ABI_FUNCTION(ncclMemAlloc)                                                                                   \
    ABI_FUNCTION(ncclMemFree) ABI_FUNCTION(ncclGetVersion) ABI_FUNCTION(                                         \
        ncclGetUniqueId) ABI_FUNCTION(ncclCommInitRankConfig) ABI_FUNCTION(ncclCommInitRank)                     \
        ABI_FUNCTION(ncclCommInitAll) ABI_FUNCTION(ncclCommInitRankScalable) ABI_FUNCTION(                       \
            ncclCommFinalize) ABI_FUNCTION(ncclCommDestroy) ABI_FUNCTION(ncclCommAbort)                          \
            ABI_FUNCTION(ncclCommRevoke) ABI_FUNCTION(ncclCommSplit) ABI_FUNCTION(                               \
                ncclCommShrink) ABI_FUNCTION(ncclGetErrorString) ABI_FUNCTION(ncclGetLastError)                  \
                ABI_FUNCTION(ncclCommGetAsyncError) ABI_FUNCTION(ncclCommCount) ABI_FUNCTION(                    \
                    ncclCommCuDevice) ABI_FUNCTION(ncclCommUserRank)                                             \
                    ABI_FUNCTION(ncclCommRegister) ABI_FUNCTION(ncclCommDeregister) ABI_FUNCTION(                \
                        ncclCommWindowRegister) ABI_FUNCTION(ncclCommWindowDeregister)                           \
                        ABI_FUNCTION(ncclRedOpCreatePreMulSum) ABI_FUNCTION(ncclRedOpDestroy)                    \
                            ABI_FUNCTION(ncclReduce) ABI_FUNCTION(ncclBcast) ABI_FUNCTION(                       \
                                ncclBroadcast) ABI_FUNCTION(ncclAllReduce)                                       \
                                ABI_FUNCTION(ncclReduceScatter) ABI_FUNCTION(ncclAllGather)                      \
                                    ABI_FUNCTION(ncclAlltoAll) ABI_FUNCTION(ncclGather)                          \
                                        ABI_FUNCTION(ncclScatter) ABI_FUNCTION(ncclSend)                         \
                                            ABI_FUNCTION(ncclRecv) ABI_FUNCTION(ncclGroupStart)                  \
                                                ABI_FUNCTION(ncclGroupEnd)                                       \
                                                    ABI_FUNCTION(ncclGroupSimulateEnd) return t;                 \
  }
