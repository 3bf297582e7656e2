// SPDX-License-Identifier: GPL-2.0
// cubevs switch: TC ingress on the hub side of every sandbox veth (= packets
// coming FROM the sandbox).  Anti-spoof (IP+MAC, ARP), no IPv6, no
// sandbox->sandbox, no host services except gateway ports + our DNS (the host:
// the gateway ip, hub_addrs, loopback, multicast, broadcast, and for l4_allow
// whatever the hub routes to itself), TCP
// 80/443 passed on (steered to the gateway by nftables REDIRECT in the hub),
// everything else only if listed in l4_allow.  Every verdict is counted per
// sandbox and reason; drops are reported through a ring buffer.
// The control plane (cubevs/datapath.py) owns all maps; the layouts and the
// reason enum below are mirrored in cubevs/switch_schema.py, and a test checks
// that mirror against this object's BTF (tests/cubevs/test_switch_schema.py).
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "GPL";

// ---- reasons (REASON_CODES in switch_schema.py: name = lower case without R_) ----
enum reason {
	R_UNKNOWN_SANDBOX = 0,   // drop: ifindex has no sandbox entry (fail closed)
	R_GATEWAY = 1,           // allow: TCP to gateway ip : gateway port
	R_DNS = 2,               // allow: UDP/TCP 53 to gateway ip
	R_WEB = 3,               // allow: TCP 80/443 to the outside (steered)
	R_L4_ALLOW = 4,          // allow: listed in l4_allow
	R_ARP = 5,               // allow: valid ARP from the sandbox
	R_SPOOF_IP = 6,
	R_SPOOF_MAC = 7,
	R_ARP_SPOOF = 8,
	R_IPV6 = 9,
	R_SANDBOX_TO_SANDBOX = 10,
	R_HOST_SERVICE = 11,
	R_QUIC = 12,
	R_FOREIGN_DNS = 13,
	R_PORT_NOT_ALLOWED = 14,
	R_FRAGMENT = 15,
	R_MALFORMED = 16,
	R_ETHERTYPE = 17,
	R_MAX = 18,
};

#define MAX_GW_PORTS 8
#define SB_F_ENABLED 1

struct sandbox {
	__u32 ip;        // network byte order
	__u8 mac[6];
	__u16 _pad;
	__u32 sandbox_no;
	__u32 flags;
};

struct config {
	__u32 gateway_ip;  // network byte order
	__u32 pool_net;    // network byte order
	__u32 pool_mask;   // network byte order
	__u16 dns_port;    // host byte order
	__u16 n_gw_ports;
	__u16 gw_ports[MAX_GW_PORTS];  // host byte order
	__u16 web_ports[2];            // host byte order (80, 443)
};

struct l4_key {
	__u32 prefixlen;   // 64 + cidr prefix length
	__u32 sandbox_no;
	__u16 port;        // host byte order; 0 = any port
	__u8 proto;        // IPPROTO_*
	__u8 _pad;
	__u32 daddr;       // network byte order
};

struct counter_key {
	__u32 sandbox_no;
	enum reason reason;   // 4 bytes; typed so the enum is in the BTF
};

struct counter_val {
	__u64 packets;
	__u64 bytes;
};

struct event {
	__u64 ts_ns;
	__u32 ifindex;
	__u32 sandbox_no;
	enum reason reason;
	__u32 saddr;   // network byte order
	__u32 daddr;   // network byte order
	__u16 dport;   // host byte order
	__u8 proto;
	__u8 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);              // hub-side ifindex
	__type(value, struct sandbox);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} sandboxes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);              // extra hub/host addresses (network order)
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hub_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__type(key, struct l4_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} l4_allow SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 262144);
	__type(key, struct counter_key);
	__type(value, struct counter_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} events SEC(".maps");

static __always_inline int is_allow(__u32 r)
{
	return r >= R_GATEWAY && r <= R_ARP;
}

static __always_inline void count(__u32 sandbox_no, __u32 reason, __u32 len)
{
	struct counter_key k = { .sandbox_no = sandbox_no, .reason = reason };
	struct counter_val *v = bpf_map_lookup_elem(&counters, &k);
	if (!v) {
		struct counter_val zero = {};
		bpf_map_update_elem(&counters, &k, &zero, BPF_NOEXIST);
		v = bpf_map_lookup_elem(&counters, &k);
		if (!v)
			return;
	}
	v->packets += 1;   // per-CPU value: no atomics needed
	v->bytes += len;
}

// Not inlined, so that struct event (the ring buffer record) is in the BTF.
static __noinline void report_drop(const struct event *e)
{
	bpf_ringbuf_output(&events, (void *)e, sizeof(*e), 0);   // ring full: still counted
}

// ifindex: the caller's copy of skb->ifindex (a second read of it lets clang keep a ctx+off
// pointer in a register, which the verifier refuses)
static __always_inline int verdict(struct __sk_buff *skb, __u32 ifindex, __u32 sandbox_no, __u32 reason,
				   __u32 saddr, __u32 daddr, __u8 proto, __u16 dport)
{
	count(sandbox_no, reason, skb->len);
	if (is_allow(reason))
		return TC_ACT_OK;
	struct event e = {
		.ts_ns = bpf_ktime_get_ns(), .ifindex = ifindex, .sandbox_no = sandbox_no,
		.reason = reason, .saddr = saddr, .daddr = daddr, .dport = dport, .proto = proto,
	};
	report_drop(&e);
	return TC_ACT_SHOT;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] &&
	       a[3] == b[3] && a[4] == b[4] && a[5] == b[5];
}

#define ARPHRD_ETHER 1
struct arp_hdr {   // <linux/if_arp.h> drags in glibc headers that do not build for -target bpf
	__be16 ar_hrd;
	__be16 ar_pro;
	__u8 ar_hln;
	__u8 ar_pln;
	__be16 ar_op;
};

struct arp_eth_ipv4 {
	struct arp_hdr h;
	__u8 sha[ETH_ALEN];
	__u8 spa[4];
	__u8 tha[ETH_ALEN];
	__u8 tpa[4];
} __attribute__((packed));

static __always_inline int l4_allowed(__u32 sandbox_no, __u8 proto, __u16 dport, __u32 daddr)
{
	struct l4_key k = {
		.prefixlen = 64 + 32, .sandbox_no = sandbox_no,
		.port = dport, .proto = proto, ._pad = 0, .daddr = daddr,
	};
	if (bpf_map_lookup_elem(&l4_allow, &k))
		return 1;
	k.port = 0;   // entry for "any port" of this proto
	return bpf_map_lookup_elem(&l4_allow, &k) != 0;
}

#define AF_INET 2
// Would the hub deliver daddr to itself (one of its addresses, also one added after the
// switch started and so in no map; a broadcast or multicast route)? Then it is a host
// service, whatever l4_allow says: an allowed range may hold an address of the host.
// Fail closed: a lookup that cannot say (an error, forwarding off) counts as the host.
static __always_inline int hub_delivers_locally(struct __sk_buff *skb, __u32 ifindex, __u32 saddr,
						__u32 daddr, __u8 l4, __u16 dport)
{
	struct bpf_fib_lookup p = {};
	p.family = AF_INET;
	p.l4_protocol = l4;
	p.dport = bpf_htons(dport);
	p.ipv4_src = saddr;
	p.ipv4_dst = daddr;
	p.ifindex = ifindex;
	long rc = bpf_fib_lookup(skb, &p, sizeof(p), 0);
	return rc < 0 || rc == BPF_FIB_LKUP_RET_NOT_FWDED || rc == BPF_FIB_LKUP_RET_FWD_DISABLED;
}

SEC("tc")
int cubevs_ingress(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 ifindex = skb->ifindex;
	__u32 zero = 0;

	struct sandbox *sb = bpf_map_lookup_elem(&sandboxes, &ifindex);
	struct config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!sb || !cfg || !(sb->flags & SB_F_ENABLED))
		return verdict(skb, ifindex, 0, R_UNKNOWN_SANDBOX, 0, 0, 0, 0);
	__u32 no = sb->sandbox_no;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return verdict(skb, ifindex, no, R_MALFORMED, 0, 0, 0, 0);

	__u16 proto = bpf_ntohs(eth->h_proto);
	if (proto == ETH_P_IPV6)
		return verdict(skb, ifindex, no, R_IPV6, 0, 0, 0, 0);

	if (proto == ETH_P_ARP) {
		struct arp_eth_ipv4 *arp = (void *)(eth + 1);
		if ((void *)(arp + 1) > data_end)
			return verdict(skb, ifindex, no, R_MALFORMED, 0, 0, 0, 0);
		__u32 spa, tpa;
		__builtin_memcpy(&spa, arp->spa, 4);
		__builtin_memcpy(&tpa, arp->tpa, 4);
		if (arp->h.ar_hrd != bpf_htons(ARPHRD_ETHER) || arp->h.ar_pro != bpf_htons(ETH_P_IP) ||
		    arp->h.ar_hln != ETH_ALEN || arp->h.ar_pln != 4)
			return verdict(skb, ifindex, no, R_MALFORMED, spa, tpa, 0, 0);
		if (!mac_eq(eth->h_source, sb->mac) || !mac_eq(arp->sha, sb->mac) || spa != sb->ip)
			return verdict(skb, ifindex, no, R_ARP_SPOOF, spa, tpa, 0, 0);
		// Only ask for the gateway, or announce itself (gratuitous ARP).
		if (tpa != cfg->gateway_ip && tpa != sb->ip)
			return verdict(skb, ifindex, no, R_ARP_SPOOF, spa, tpa, 0, 0);
		return verdict(skb, ifindex, no, R_ARP, spa, tpa, 0, 0);
	}

	if (proto != ETH_P_IP)
		return verdict(skb, ifindex, no, R_ETHERTYPE, 0, 0, 0, 0);

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return verdict(skb, ifindex, no, R_MALFORMED, 0, 0, 0, 0);
	__u32 saddr = ip->saddr, daddr = ip->daddr;
	__u8 l4 = ip->protocol;
	if (ip->version != 4 || ip->ihl < 5)
		return verdict(skb, ifindex, no, R_MALFORMED, saddr, daddr, l4, 0);
	if (!mac_eq(eth->h_source, sb->mac))
		return verdict(skb, ifindex, no, R_SPOOF_MAC, saddr, daddr, l4, 0);
	if (saddr != sb->ip)
		return verdict(skb, ifindex, no, R_SPOOF_IP, saddr, daddr, l4, 0);
	// Fragments carry no (or a partial) L4 header: fail closed.
	if (ip->frag_off & bpf_htons(0x3fff))
		return verdict(skb, ifindex, no, R_FRAGMENT, saddr, daddr, l4, 0);

	__u16 dport = 0;
	void *l4h = (void *)ip + ip->ihl * 4;
	if (l4 == IPPROTO_TCP || l4 == IPPROTO_UDP) {
		struct udphdr *uh = l4h;   // ports sit at the same offsets in TCP and UDP
		if ((void *)(uh + 1) > data_end)
			return verdict(skb, ifindex, no, R_MALFORMED, saddr, daddr, l4, 0);
		dport = bpf_ntohs(uh->dest);
	}

	__u32 d = bpf_ntohl(daddr);
	int to_hub = daddr == cfg->gateway_ip || bpf_map_lookup_elem(&hub_addrs, &daddr) ||
		     (d >> 24) == 127 || (d >> 24) == 0 || (d >> 28) == 0xe || d == 0xffffffff;
	if (to_hub) {
		if (l4 == IPPROTO_TCP) {
			__u16 n = cfg->n_gw_ports;
#pragma unroll
			for (int i = 0; i < MAX_GW_PORTS; i++)
				if (i < n && cfg->gw_ports[i] == dport)
					return verdict(skb, ifindex, no, R_GATEWAY, saddr, daddr, l4, dport);
		}
		if ((l4 == IPPROTO_UDP || l4 == IPPROTO_TCP) && dport == cfg->dns_port &&
		    daddr == cfg->gateway_ip)
			return verdict(skb, ifindex, no, R_DNS, saddr, daddr, l4, dport);
		return verdict(skb, ifindex, no, R_HOST_SERVICE, saddr, daddr, l4, dport);
	}
	if ((daddr & cfg->pool_mask) == cfg->pool_net)
		return verdict(skb, ifindex, no, R_SANDBOX_TO_SANDBOX, saddr, daddr, l4, dport);
	if (l4 == IPPROTO_TCP && (dport == cfg->web_ports[0] || dport == cfg->web_ports[1]))
		return verdict(skb, ifindex, no, R_WEB, saddr, daddr, l4, dport);
	if (l4 == IPPROTO_UDP && dport == 443)
		return verdict(skb, ifindex, no, R_QUIC, saddr, daddr, l4, dport);
	if ((l4 == IPPROTO_UDP || l4 == IPPROTO_TCP) && (dport == 53 || dport == cfg->dns_port))
		return verdict(skb, ifindex, no, R_FOREIGN_DNS, saddr, daddr, l4, dport);
	if (l4_allowed(no, l4, dport, daddr)) {
		if (hub_delivers_locally(skb, ifindex, saddr, daddr, l4, dport))
			return verdict(skb, ifindex, no, R_HOST_SERVICE, saddr, daddr, l4, dport);
		return verdict(skb, ifindex, no, R_L4_ALLOW, saddr, daddr, l4, dport);
	}
	return verdict(skb, ifindex, no, R_PORT_NOT_ALLOWED, saddr, daddr, l4, dport);
}
