//go:build race

package localcluster

const raceEnabled = true
