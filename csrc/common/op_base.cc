// SPDX-License-Identifier: MIT
#include "common/op_base.h"

namespace ort_ops {

namespace {
OrtStatusPtr to_status(const char* op, OrtErrorCode code, const std::string& msg) {
  return Ort::GetApi().CreateStatus(code, msg.c_str());
}
}  // namespace

OrtStatusPtr KernelAdapter::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    impl->compute(ctx);
    return nullptr;
  } catch (const OpError& e) {
    return to_status(op_name, e.code(), e.what());
  } catch (const Ort::Exception& e) {
    return to_status(op_name, e.GetOrtErrorCode(), str_cat(op_name, ": ", e.what()));
  } catch (const std::bad_alloc&) {
    return to_status(op_name, ORT_FAIL, str_cat(op_name, ": out of memory"));
  } catch (const std::exception& e) {
    return to_status(op_name, ORT_FAIL, str_cat(op_name, ": ", e.what()));
  }
}

OrtStatusPtr CustomOp::CreateKernelV2(const OrtApi&, const OrtKernelInfo* info,
                                      void** kernel) const {
  try {
    auto adapter = std::make_unique<KernelAdapter>();
    adapter->impl = factory_(info);
    adapter->op_name = spec_.name;
    *kernel = adapter.release();
    return nullptr;
  } catch (const OpError& e) {
    return to_status(spec_.name, e.code(), e.what());
  } catch (const std::exception& e) {
    return to_status(spec_.name, ORT_FAIL, str_cat(spec_.name, ": ", e.what()));
  }
}

bool has_attr(const OrtKernelInfo* info, const char* name) {
  size_t size = 0;
  // Asking for the size of a string attribute fails for absent names; for other kinds we probe
  // with the typed getters below.
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st == nullptr) return true;
  Ort::GetApi().ReleaseStatus(st);
  int64_t i = 0;
  st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &i);
  if (st == nullptr) return true;
  Ort::GetApi().ReleaseStatus(st);
  float f = 0;
  st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &f);
  if (st == nullptr) return true;
  Ort::GetApi().ReleaseStatus(st);
  return false;
}

int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t default_value) {
  int64_t v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (st == nullptr) return v;
  Ort::GetApi().ReleaseStatus(st);
  return default_value;
}

float attr_float(const OrtKernelInfo* info, const char* name, float default_value) {
  float v = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (st == nullptr) return v;
  Ort::GetApi().ReleaseStatus(st);
  return default_value;
}

std::string attr_string(const OrtKernelInfo* info, const char* name,
                        const std::string& default_value) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st != nullptr) {
    Ort::GetApi().ReleaseStatus(st);
    return default_value;
  }
  std::string out(size, '\0');
  st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, out.data(), &size);
  if (st != nullptr) {
    Ort::GetApi().ReleaseStatus(st);
    return default_value;
  }
  if (!out.empty() && out.back() == '\0') out.pop_back();
  return out;
}

}  // namespace ort_ops
