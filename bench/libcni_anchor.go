// libcni-anchor: the anchor of bench/overhead.py's and bench/crio_pattern.py's
// libcni figures. One Go process embedding libcni, as containerd and CRI-O
// do, running a conflist once per line it reads:
//
//	pair NETNS   ADD then DEL (AddNetworkList, DelNetworkList)
//	pod NETNS    ADD, CHECK, DEL, as CRI-O runs a pod: with CRI-O's CNI_ARGS
//	             and runtimeConfig (cgroupPath, pod annotations)
//
//	libcni-anchor CONFLIST PLUGIN_DIR CACHE_DIR
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
	"strings"
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

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: libcni-anchor CONFLIST PLUGIN_DIR CACHE_DIR")
		os.Exit(2)
	}
	list, err := libcni.ConfListFromFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	cni := libcni.NewCNIConfigWithCacheDir([]string{os.Args[2]}, os.Args[3], nil)
	ctx := context.Background()
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for n := 0; in.Scan(); n++ {
		mode, netns, _ := strings.Cut(in.Text(), " ")
		id := fmt.Sprintf("anchor-%d", n)
		rt := &libcni.RuntimeConf{ContainerID: id, NetNS: netns, IfName: "eth0"}
		if mode == "pod" { // as CRI-O's ocicni builds it
			rt.Args = [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", "bench"},
				{"K8S_POD_NAME", id}, {"K8S_POD_INFRA_CONTAINER_ID", id}, {"K8S_POD_UID", "uid-" + id}}
			rt.CapabilityArgs = map[string]interface{}{
				"cgroupPath":                        "/kubepods/besteffort/pod-bench",
				"io.kubernetes.cri.pod-annotations": map[string]string{"kubernetes.io/config.source": "api"},
			}
		}
		c0, t0 := cpuNs(), time.Now()
		if _, err := cni.AddNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "ADD:", err)
			os.Exit(1)
		}
		if mode == "pod" {
			if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
				fmt.Fprintln(os.Stderr, "CHECK:", err)
				os.Exit(1)
			}
		}
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "DEL:", err)
			os.Exit(1)
		}
		fmt.Fprintf(out, "%d %d\n", time.Since(t0).Nanoseconds(), cpuNs()-c0)
		out.Flush()
	}
}
