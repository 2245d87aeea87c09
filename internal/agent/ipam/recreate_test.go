package ipam

import "testing"

func TestShouldRecreate(t *testing.T) {
	had := RecordMark{UID: "u1", Generation: 3}
	for _, tc := range []struct {
		name        string
		mark        RecordMark
		attachments int
		node        bool
		want        bool
	}{
		{"had one, pods use addresses, node exists", had, 2, true, true},
		{"never had one: the controller creates it", RecordMark{}, 2, true, false},
		{"no pod uses an address: nothing to protect", had, 0, true, false},
		{"node gone: the controller deletes, the agent must not resurrect", had, 2, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ShouldRecreate(tc.mark, tc.attachments, tc.node); got != tc.want {
				t.Fatalf("ShouldRecreate = %v, want %v", got, tc.want)
			}
		})
	}
}
