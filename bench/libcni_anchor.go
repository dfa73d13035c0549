// libcni-anchor: the anchor of bench/overhead.py's libcni figures. One Go
// process embedding libcni, as containerd and CRI-O do, running a conflist's
// ADD then DEL (AddNetworkList, DelNetworkList: cache written and removed)
// once per line it reads.
//
//	libcni-anchor CONFLIST PLUGIN_DIR CACHE_DIR
//
// Each stdin line is a netns path; for each it prints "WALL_NS CPU_NS": the
// pair's wall time and this process's own CPU over it (getrusage: all its
// threads, not the plugins, which are the same for every way). Built by
// tools/build-crio against CRI-O's vendored libcni (go build -overlay), so no
// module is fetched.
package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
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
		rt := &libcni.RuntimeConf{ContainerID: fmt.Sprintf("anchor-%d", n), NetNS: in.Text(), IfName: "eth0"}
		c0, t0 := cpuNs(), time.Now()
		if _, err := cni.AddNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "ADD:", err)
			os.Exit(1)
		}
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			fmt.Fprintln(os.Stderr, "DEL:", err)
			os.Exit(1)
		}
		fmt.Fprintf(out, "%d %d\n", time.Since(t0).Nanoseconds(), cpuNs()-c0)
		out.Flush()
	}
}
