#include "hp/pp/transport.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>

#include "hp/util/error.h"

namespace hp::pp {

namespace {

class DoneHandle : public TransferHandle {
 public:
  void wait() override {}
};

}  // namespace

struct LoopbackTransport::Mailboxes {
  std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable arrived;
  // (from, to, tag) -> tensors in the order sent.
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> boxes;
};

namespace {

class LoopbackRecv : public TransferHandle {
 public:
  LoopbackRecv(std::shared_ptr<LoopbackTransport::Mailboxes> boxes, at::Tensor into, int from,
               int to, int tag)
      : boxes_(std::move(boxes)), into_(std::move(into)), key_(from, to, tag) {}

  void wait() override {
    if (done_) return;
    std::unique_lock<std::mutex> lock(boxes_->mutex);
    auto& box = boxes_->boxes[key_];
    if (!boxes_->arrived.wait_for(lock, boxes_->timeout, [&] { return !box.empty(); })) {
      throw CollectiveError(
          hp::cat("pipeline loopback: recv from pipeline rank ", std::get<0>(key_), " to ",
                  std::get<1>(key_), " (tag ", std::get<2>(key_), ", ", into_.sizes(), " ",
                  into_.scalar_type(), ") timed out after ", boxes_->timeout.count(), " ms"));
    }
    at::Tensor sent = std::move(box.front());
    box.pop_front();
    lock.unlock();
    HP_CHECK_ARG(sent.sizes() == into_.sizes() && sent.scalar_type() == into_.scalar_type(),
                 "pipeline loopback: rank ", std::get<1>(key_), " expected ", into_.sizes(), " ",
                 into_.scalar_type(), " from rank ", std::get<0>(key_), " (tag ", std::get<2>(key_),
                 ") but got ", sent.sizes(), " ", sent.scalar_type());
    into_.copy_(sent);
    done_ = true;
  }

 private:
  std::shared_ptr<LoopbackTransport::Mailboxes> boxes_;
  at::Tensor into_;
  std::tuple<int, int, int> key_;
  bool done_ = false;
};

}  // namespace

std::vector<std::shared_ptr<LoopbackTransport>> LoopbackTransport::make(
    int size, std::chrono::milliseconds timeout) {
  HP_CHECK_ARG(size >= 1, "LoopbackTransport: size ", size, " must be at least 1");
  auto boxes = std::make_shared<Mailboxes>();
  boxes->timeout = timeout;
  std::vector<std::shared_ptr<LoopbackTransport>> transports;
  for (int r = 0; r < size; ++r)
    transports.push_back(std::shared_ptr<LoopbackTransport>(new LoopbackTransport(r, size, boxes)));
  return transports;
}

std::vector<std::unique_ptr<TransferHandle>> Transport::post(
    const std::vector<Transfer>& transfers) {
  std::vector<std::unique_ptr<TransferHandle>> handles;
  handles.reserve(transfers.size());
  for (const Transfer& t : transfers)
    handles.push_back(t.send ? send(t.tensor, t.peer, t.tag) : recv(t.tensor, t.peer, t.tag));
  return handles;
}

LoopbackTransport::LoopbackTransport(int rank, int size, std::shared_ptr<Mailboxes> boxes)
    : rank_(rank), size_(size), boxes_(std::move(boxes)) {}

std::unique_ptr<TransferHandle> LoopbackTransport::send(const at::Tensor& tensor, int peer,
                                                        int tag) {
  HP_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, "LoopbackTransport::send: peer ", peer,
               " must be another rank in [0, ", size_, ")");
  {
    std::lock_guard<std::mutex> lock(boxes_->mutex);
    boxes_->boxes[{rank_, peer, tag}].push_back(tensor.clone());
  }
  boxes_->arrived.notify_all();
  return std::make_unique<DoneHandle>();
}

std::unique_ptr<TransferHandle> LoopbackTransport::recv(const at::Tensor& tensor, int peer,
                                                        int tag) {
  HP_CHECK_ARG(peer >= 0 && peer < size_ && peer != rank_, "LoopbackTransport::recv: peer ", peer,
               " must be another rank in [0, ", size_, ")");
  return std::make_unique<LoopbackRecv>(boxes_, tensor, peer, rank_, tag);
}

}  // namespace hp::pp
