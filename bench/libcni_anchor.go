// libcni-anchor: the anchor of bench/overhead.py's, bench/concurrency.py's and
// bench/crio_pattern.py's libcni figures. One Go process embedding libcni, as
// containerd and CRI-O do, running a conflist as each line it reads says:
//
//	pair NETNS        ADD then DEL (AddNetworkList, DelNetworkList)
//	pod NETNS         ADD, CHECK, DEL, as CRI-O runs a pod: with CRI-O's CNI_ARGS
//	                  and runtimeConfig (cgroupPath, pod annotations)
//	many NETNS...     ADD in every NETNS at once (a goroutine each, with a
//	                  container id of its own), then, all added, DEL in every
//	                  one at once: a runtime handling many pods at once
//
//	libcni-anchor CONFLIST PLUGIN_DIR[:PLUGIN_DIR...] CACHE_DIR
//
// For each line it prints "WALL_NS CPU_NS": the wall time and this process's
// own CPU over it (getrusage: all its threads, not the plugins', which are
// the same for every way; but the kernel's work of spawning and reaping them
// is this process's, as it is the agent's). Built by tools/build-crio against
// CRI-O's vendored libcni (go build -overlay), so no module is fetched.
package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
)

func cpuNs() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

func fail(what string, err error) {
	fmt.Fprintln(os.Stderr, what+":", err)
	os.Exit(1)
}

type anchor struct {
	cni  *libcni.CNIConfig
	list *libcni.NetworkConfigList
	ctx  context.Context
}

func (a *anchor) runtimeConf(id, netns string, crio bool) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{ContainerID: id, NetNS: netns, IfName: "eth0"}
	if crio { // as CRI-O's ocicni builds it
		rt.Args = [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "bench"},
			{"K8S_POD_NAME", id}, {"K8S_POD_INFRA_CONTAINER_ID", id}, {"K8S_POD_UID", "uid-" + id}}
		rt.CapabilityArgs = map[string]interface{}{
			"cgroupPath":                        "/kubepods/besteffort/pod-bench",
			"io.kubernetes.cri.pod-annotations": map[string]string{"kubernetes.io/config.source": "api"},
		}
	}
	return rt
}

// one runs ADD (and CHECK for a pod) then DEL in one netns.
func (a *anchor) one(id, netns string, pod bool) {
	rt := a.runtimeConf(id, netns, pod)
	if _, err := a.cni.AddNetworkList(a.ctx, a.list, rt); err != nil {
		fail("ADD", err)
	}
	if pod {
		if err := a.cni.CheckNetworkList(a.ctx, a.list, rt); err != nil {
			fail("CHECK", err)
		}
	}
	if err := a.cni.DelNetworkList(a.ctx, a.list, rt); err != nil {
		fail("DEL", err)
	}
}

// many runs every ADD at once, waits for all, then every DEL at once. Every
// DEL runs even after a failed ADD, so a failure leaves nothing behind.
func (a *anchor) many(prefix string, spaces []string) {
	rts := make([]*libcni.RuntimeConf, len(spaces))
	for i, netns := range spaces {
		rts[i] = a.runtimeConf(fmt.Sprintf("%s-%d", prefix, i), netns, false)
	}
	var first error
	var mu sync.Mutex
	all := func(call func(*libcni.RuntimeConf) error) {
		var wg sync.WaitGroup
		for _, rt := range rts {
			wg.Add(1)
			go func(rt *libcni.RuntimeConf) {
				defer wg.Done()
				if err := call(rt); err != nil {
					mu.Lock()
					if first == nil {
						first = fmt.Errorf("%s: %w", rt.ContainerID, err)
					}
					mu.Unlock()
				}
			}(rt)
		}
		wg.Wait()
	}
	all(func(rt *libcni.RuntimeConf) error { _, err := a.cni.AddNetworkList(a.ctx, a.list, rt); return err })
	all(func(rt *libcni.RuntimeConf) error { return a.cni.DelNetworkList(a.ctx, a.list, rt) })
	if first != nil {
		fail("many", first)
	}
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: libcni-anchor CONFLIST PLUGIN_DIR[:PLUGIN_DIR...] CACHE_DIR")
		os.Exit(2)
	}
	list, err := libcni.ConfListFromFile(os.Args[1])
	if err != nil {
		fail("conflist", err)
	}
	a := &anchor{cni: libcni.NewCNIConfigWithCacheDir(filepath.SplitList(os.Args[2]), os.Args[3], nil),
		list: list, ctx: context.Background()}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64*1024), 16*1024*1024) // a `many` line names thousands of paths
	out := bufio.NewWriter(os.Stdout)
	for n := 0; in.Scan(); n++ {
		words := strings.Fields(in.Text())
		if len(words) < 2 {
			fail("input", fmt.Errorf("%q: want MODE NETNS...", in.Text()))
		}
		id := fmt.Sprintf("anchor-%d", n)
		c0, t0 := cpuNs(), time.Now()
		switch mode := words[0]; {
		case (mode == "pair" || mode == "pod") && len(words) == 2:
			a.one(id, words[1], mode == "pod")
		case mode == "many":
			a.many(id, words[1:])
		default:
			fail("input", fmt.Errorf("%q: unknown mode or wrong number of paths", in.Text()))
		}
		fmt.Fprintf(out, "%d %d\n", time.Since(t0).Nanoseconds(), cpuNs()-c0)
		out.Flush()
	}
}
