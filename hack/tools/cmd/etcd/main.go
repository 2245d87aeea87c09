// Command etcd is a minimal etcd server around go.etcd.io/etcd/server/v3/embed,
// enough to back a test kube-apiserver on loopback. Its subcommands save and restore a
// snapshot as etcdctl and etcdutl do, for the tests that restore etcd from a backup:
//
//	etcd snapshot save URL FILE
//	etcd snapshot restore FILE DATA-DIR PEER-URL   (--bump-revision 1000000000 --mark-compacted)
package main

import (
	"context"
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	clientsnapshot "go.etcd.io/etcd/client/v3/snapshot"
	"go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// snapshotCommand is `etcd snapshot save|restore ...`. A restore follows Kubernetes' documented
// procedure: it bumps the revision by 1,000,000,000 and marks it compacted, so clients relist
// instead of missing changes (https://kubernetes.io/docs/tasks/administer-cluster/configure-upgrade-etcd/).
func snapshotCommand(args []string) {
	if len(args) >= 3 && args[0] == "save" {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := clientsnapshot.SaveWithVersion(ctx, zap.NewNop(), clientv3.Config{Endpoints: []string{args[1]}, DialTimeout: 10 * time.Second}, args[2]); err != nil {
			log.Fatalf("snapshot save: %v", err)
		}
		return
	}
	if len(args) >= 4 && args[0] == "restore" {
		cfg := embed.NewConfig()
		err := snapshot.NewV3(zap.NewNop()).Restore(snapshot.RestoreConfig{
			SnapshotPath: args[1], Name: cfg.Name, OutputDataDir: args[2], PeerURLs: []string{args[3]},
			InitialCluster: cfg.Name + "=" + args[3], InitialClusterToken: cfg.InitialClusterToken,
			RevisionBump: 1_000_000_000, MarkCompacted: true,
		})
		if err != nil {
			log.Fatalf("snapshot restore: %v", err)
		}
		return
	}
	log.Fatal("usage: etcd snapshot save URL FILE | etcd snapshot restore FILE DATA-DIR PEER-URL")
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "snapshot" {
		snapshotCommand(os.Args[2:])
		return
	}
	dataDir := flag.String("data-dir", "", "data directory (required)")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL")
	noFsync := flag.Bool("unsafe-no-fsync", false, "skip fsync (tests only)")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}
	cu, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("--listen-client-urls: %v", err)
	}
	pu, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("--listen-peer-urls: %v", err)
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = cfg.Name + "=" + pu.String()
	cfg.UnsafeNoFsync = *noFsync
	cfg.LogLevel = "error"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	<-e.Server.ReadyNotify()
	log.Printf("etcd ready on %s", cu)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case <-sig:
	case err := <-e.Err():
		log.Printf("etcd error: %v", err)
	}
	e.Close()
}
