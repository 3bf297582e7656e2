// SPDX-License-Identifier: GPL-2.0
// cubevs splice: joins two TCP sockets in the kernel so a relay's payload never
// reaches userspace.  An sk_skb stream_verdict program on the `spliced` sockhash
// sends every skb received on a socket out of its peer (bpf_sk_redirect_hash,
// egress) and counts the bytes per socket in `links`.
//
// Two sockhashes, both keyed by socket cookie:
//   targets  no program: where redirects land.  A socket joins it first, so its
//            peer can already send to it while its own receive path is untouched.
//   spliced  the verdict program: a socket joins it once everything userspace
//            holds for its peer has been written (no reordering), and from then
//            on its bytes go to the peer's `targets` entry.
// The control plane (cubevs/splice.py) owns the maps; this program only reads
// `links` and adds to its counters.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

#define MAX_SOCKETS 65536

struct link {
	__u64 peer;      // cookie of the socket our bytes are sent out of
	__u64 bytes;     // bytes received on this socket and handed to the peer
	__u64 dropped;   // bytes the verdict could not hand over (stream broken)
};

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u64);
	__type(value, __u64);
} targets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u64);
	__type(value, __u64);
} spliced SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u64);
	__type(value, struct link);
} links SEC(".maps");

// Flow control: the kernel queues a redirect into a peer that does not take it without
// bound, so userspace gives every socket a budget (bytes it may hand over before userspace
// looks again).  Past it the verdict still hands the skb over (it cannot push back) but
// tells userspace at once through `alerts` (the socket's cookie), once per budget; userspace
// then holds the socket (out of `spliced`: TCP flow control holds its sender back).
struct budget {
	__u64 limit;     // `bytes` may grow to this before an alert
	__u64 alerted;   // set here, cleared by userspace with a new limit
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u64);
	__type(value, struct budget);
} budgets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} alerts SEC(".maps");

SEC("sk_skb/stream_verdict")
int splice_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct link *l = bpf_map_lookup_elem(&links, &cookie);
	if (!l)
		return SK_DROP;   // not ours (cannot happen while the control plane is consistent)
	if (skb->len == 0)
		return SK_DROP;   // a bare FIN: nothing to pass on (userspace passes the FIN); redirected,
		                  // its empty send after that shutdown would set EPIPE on the peer
	__u64 peer = l->peer;
	int verdict = bpf_sk_redirect_hash(skb, &targets, &peer, 0);
	if (verdict == SK_PASS)
		__sync_fetch_and_add(&l->bytes, skb->len);
	else
		__sync_fetch_and_add(&l->dropped, skb->len);   // userspace sees it and resets both sides
	struct budget *b = bpf_map_lookup_elem(&budgets, &cookie);
	if (verdict != SK_PASS || (b && l->bytes > b->limit && !b->alerted)) {
		if (b)
			b->alerted = 1;
		bpf_ringbuf_output(&alerts, &cookie, sizeof(cookie), 0);   // full: userspace's tick still looks
	}
	return verdict;
}
